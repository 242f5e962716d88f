"""A prompt chunk's attention before and after (engine/batch.py ``mask`` / ``chunk_attention``),
side by side in one run: a bf16 prefill of ``--tokens`` tokens (chunks of 1,024) on both
embedded models, each way ``--reps`` times alternating (medians), and the share of the
prefill's operator time attention took each way (torch.profiler).

Before: a boolean mask built per layer and row, handed to transformers' SDPA wrapper (which
copies keys and values once per query head when a mask is given, and SDPA turned the mask
into an additive one on every call). After: one additive mask a step per shape, SDPA with the
KV heads shared, and a prompt's first chunk on an empty cache without a mask (plain causal:
SDPA skips the blocks above the diagonal). The numbers are the same (tests/test_chunk_attention.py).

    .venv/bin/python bench/chunk_bench.py --out docs/results/chunk_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from decode_bench import prefill_s, top_ops
from dtype_bench import DOC
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsnap.engine import Engine, batch, capture, load_model

AFTER = batch.chunk_attention, batch.mask


def before_mask(q: int, k: int, window: int | None, like: torch.Tensor) -> torch.Tensor | None:
    """The mask as it was: boolean, causal (and banded), None for one token only."""
    if q == 1:
        return None
    i = torch.arange(q, device=like.device).unsqueeze(1) + (k - q)
    j = torch.arange(k, device=like.device).unsqueeze(0)
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    return visible[None, None]


def use(way: str) -> None:
    attend, batch.mask = (sdpa_attention_forward, before_mask) if way == "before" else AFTER
    capture.chunk_attention = attend  # what the packed step's attention hands a prompt chunk to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "reps": args.reps, "dtype": "bfloat16"}
    for model in args.models.split(","):
        engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
        doc = engine.encode(DOC)[: args.tokens]
        prefill_s(engine, doc[:256])  # warm-up
        times = {"before": [], "after": []}
        for _ in range(args.reps):
            for way in times:
                use(way)
                times[way].append(prefill_s(engine, doc))
        row = {}
        for way, seconds in times.items():
            use(way)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                prefill_s(engine, doc)
            ops = top_ops(prof, n=12)
            attention = sum(o["share"] for o in ops if "attention" in o["op"] or o["op"] in ("aten::where", "aten::le"))
            row[way] = {"prefill_s": round(statistics.median(seconds), 3), "runs_s": [round(s, 3) for s in seconds]}
            row[way] |= {
                "tokens_per_s": round(args.tokens / statistics.median(seconds)),
                "attention_share": round(attention, 3),
            }
            row[way]["top_ops"] = ops
        row["speedup"] = round(row["before"]["prefill_s"] / row["after"]["prefill_s"], 2)
        use("after")
        report[model] = row
        print(model, row["before"]["prefill_s"], "->", row["after"]["prefill_s"], "s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
