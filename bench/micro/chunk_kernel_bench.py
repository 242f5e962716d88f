"""A prompt chunk's attention in C (cpu_kernels/chunk_attention.py) against torch's SDPA, side by side in
one run: the attention call alone at the shapes a prefill and a later chat meet (medians of
--reps alternating runs), and whole bf16 prefills of both embedded models (--tokens tokens in
chunks of 1,024, alternating, medians), with the SDPA path for the same engine switched on by
leaving the kernel out (what a CPU without AMX or AVX-512 BF16 runs). The kernel is the build
this CPU takes (AMX tiles, else AVX-512 BF16 vectors); the report names it.

    .venv/bin/python bench/micro/chunk_kernel_bench.py --out docs/results/amx_bench.json          # a CPU with AMX
    .venv/bin/python bench/micro/chunk_kernel_bench.py --out docs/results/chunk_vectors_bench.json  # AVX-512 BF16 only
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options, write_json
from harness.compare import alternate
from harness.engine import DOC, median_ms, prefill_s

from kvsnap.cpu_kernels import build, chunk_attention
from kvsnap.engine import Engine, batch, load_model

KERNEL = chunk_attention.available
WAYS = ("sdpa", "kernel")

# (label, heads, KV heads, head dim, chunk, rows, window)
SHAPES = [
    ("smollm2 2K prefill, 2nd chunk", 9, 3, 64, 1024, 2048, None),
    ("smollm2 later chat: 120 new over 2,430 rows", 9, 3, 64, 120, 2430, None),
    ("smollm2 follow-up: 24 new over 2,450 rows", 9, 3, 64, 24, 2450, None),
    ("gemma3 2K prefill, 2nd chunk, full layer", 4, 1, 256, 1024, 2048, None),
    ("gemma3 2K prefill, 2nd chunk, sliding layer", 4, 1, 256, 1024, 1535, 512),
]


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
            chunk_attention.attention(query, keys, values, scale, window)

        times = {"sdpa": [], "kernel": []}
        for _ in range(3):  # alternating rounds, each a median of reps calls
            times["sdpa"].append(median_ms(sdpa, reps))
            times["kernel"].append(median_ms(kernel, reps))
        sdpa_ms, kernel_ms = statistics.median(times["sdpa"]), statistics.median(times["kernel"])
        out.append({"shape": label, "sdpa_ms": round(sdpa_ms, 2), "kernel_ms": round(kernel_ms, 2),
                    "speedup": round(sdpa_ms / kernel_ms, 2)})  # fmt: skip
        print(out[-1], flush=True)
    return out


def use(way: str) -> None:
    chunk_attention.available = KERNEL if way == "kernel" else (lambda variant=None: False)


def prefill_rows(models: list[str], tokens: int, reps: int) -> dict:
    out = {}
    for model in models:
        engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
        doc = engine.encode(DOC)[:tokens]
        for way in WAYS:  # warm-up, each way
            use(way)
            prefill_s(engine, doc[:256])
        times = alternate(WAYS, use, {"s": lambda e=engine, d=doc: prefill_s(e, d)}, reps, mirror=False)["s"]
        use("kernel")
        row = {}
        for way, runs in times.items():
            row[way] = {"prefill_s": round(statistics.median(runs), 3), "runs_s": [round(x, 3) for x in runs]}
        row["speedup"] = round(row["sdpa"]["prefill_s"] / row["kernel"]["prefill_s"], 2)
        row["tokens_per_s"] = {way: round(tokens / row[way]["prefill_s"]) for way in times}
        out[model] = row
        print(model, row, flush=True)
    return out


def main() -> None:
    args = options(__doc__, "models", "tokens", "threads", "out", reps=5).parse_args()
    if KERNEL() is None:
        raise SystemExit("no chunk kernel here (no AMX or AVX-512 BF16, no compiler, or KVSNAP_C_KERNELS=0)")
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "reps": args.reps, "dtype": "bfloat16", "torch": torch.__version__}
    report["variant"] = build.chosen()  # amx (tiles) or avx512bf16 (vectors)
    report["cpu"] = build.cpu_model()
    report["operator"] = operator_rows(args.reps)
    report["prefill"] = prefill_rows(args.models.split(","), args.tokens, args.reps)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
