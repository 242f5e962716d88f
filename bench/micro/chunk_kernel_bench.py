"""A prompt chunk's attention in C (engine/chunk_kernel.py) against torch's SDPA, side by side in
one run: the attention call alone at the shapes a prefill and a later chat meet (medians of
--reps alternating runs), and whole bf16 prefills of both embedded models (--tokens tokens in
chunks of 1,024, alternating, medians), with the SDPA path for the same engine switched on by
leaving the kernel out (what a CPU without AMX or AVX-512 BF16 runs). The kernel is the build
this CPU takes (AMX tiles, else AVX-512 BF16 vectors); the report names it.

    .venv/bin/python bench/amx_bench.py --out docs/results/amx_bench.json          # a CPU with AMX
    .venv/bin/python bench/amx_bench.py --out docs/results/chunk_vectors_bench.json  # AVX-512 BF16 only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from decode_bench import prefill_s
from dtype_bench import DOC

from kvsnap.engine import Engine, batch, cbuild, chunk_kernel, load_model

KERNEL = chunk_kernel.kernel

# (label, heads, KV heads, head dim, chunk, rows, window)
SHAPES = [
    ("smollm2 2K prefill, 2nd chunk", 9, 3, 64, 1024, 2048, None),
    ("smollm2 later chat: 120 new over 2,430 rows", 9, 3, 64, 120, 2430, None),
    ("smollm2 follow-up: 24 new over 2,450 rows", 9, 3, 64, 24, 2450, None),
    ("gemma3 2K prefill, 2nd chunk, full layer", 4, 1, 256, 1024, 2048, None),
    ("gemma3 2K prefill, 2nd chunk, sliding layer", 4, 1, 256, 1024, 1535, 512),
]


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def operator_rows(reps: int) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for label, heads, kv_heads, dim, count, rows, window in SHAPES:
        query = torch.randn(1, count, heads, dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
        keys, values = (torch.randn(1, kv_heads, rows, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
        hidden = batch.mask(count, rows, window, query)
        scale = dim**-0.5

        def sdpa(query=query, keys=keys, values=values, hidden=hidden, scale=scale):
            F.scaled_dot_product_attention(query, keys, values, attn_mask=hidden, scale=scale, enable_gqa=True)

        def kernel(query=query, keys=keys, values=values, scale=scale, window=window):
            chunk_kernel.attention(query, keys, values, scale, window)

        times = {"sdpa": [], "kernel": []}
        for _ in range(3):  # alternating rounds, each a median of reps calls
            times["sdpa"].append(median_ms(sdpa, reps))
            times["kernel"].append(median_ms(kernel, reps))
        sdpa_ms, kernel_ms = statistics.median(times["sdpa"]), statistics.median(times["kernel"])
        out.append({"shape": label, "sdpa_ms": round(sdpa_ms, 2), "kernel_ms": round(kernel_ms, 2),
                    "speedup": round(sdpa_ms / kernel_ms, 2)})  # fmt: skip
        print(out[-1], flush=True)
    return out


def prefill_rows(models: list[str], tokens: int, reps: int) -> dict:
    out = {}
    for model in models:
        engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
        doc = engine.encode(DOC)[:tokens]
        times = {"sdpa": [], "kernel": []}
        for way in times:  # warm-up, each way
            batch.chunk_kernel.kernel = KERNEL if way == "kernel" else (lambda: None)
            prefill_s(engine, doc[:256])
        for _ in range(reps):
            for way in times:
                batch.chunk_kernel.kernel = KERNEL if way == "kernel" else (lambda: None)
                times[way].append(prefill_s(engine, doc))
        batch.chunk_kernel.kernel = KERNEL
        row = {}
        for way, runs in times.items():
            row[way] = {"prefill_s": round(statistics.median(runs), 3), "runs_s": [round(x, 3) for x in runs]}
        row["speedup"] = round(row["sdpa"]["prefill_s"] / row["kernel"]["prefill_s"], 2)
        row["tokens_per_s"] = {way: round(tokens / row[way]["prefill_s"]) for way in times}
        out[model] = row
        print(model, row, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if KERNEL() is None:
        raise SystemExit("no chunk kernel here (no AMX or AVX-512 BF16, no compiler, or KVSNAP_C_KERNELS=0)")
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "reps": args.reps, "dtype": "bfloat16", "torch": torch.__version__}
    report["build"] = chunk_kernel.build()  # tiles or vectors
    report["cpu"] = cbuild.cpu_model()
    report["operator"] = operator_rows(args.reps)
    report["prefill"] = prefill_rows(args.models.split(","), args.tokens, args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
