"""A prompt chunk's attention before and after (engine/batch.py ``mask`` / ``chunk_attention``),
side by side in one run: a bf16 prefill of ``--tokens`` tokens (chunks of 1,024) on both
embedded models, each way ``--reps`` times alternating (medians), and the share of the
prefill's operator time attention took each way (torch.profiler).

Before: a boolean mask built per layer and row, handed to transformers' SDPA wrapper (which
copies keys and values once per query head when a mask is given, and SDPA turned the mask
into an additive one on every call). After: one additive mask a step per shape, SDPA with the
KV heads shared, and a prompt's first chunk on an empty cache without a mask (plain causal:
SDPA skips the blocks above the diagonal). The numbers are the same (tests/engine/test_chunk_mask_and_sdpa.py).

    .venv/bin/python bench/micro/chunk_mask_bench.py --out docs/results/chunk_bench.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options
from harness.compare import alternate, report_models
from harness.engine import bench_doc, bf16_engine, prefill_s, profiled

from kvsnap.engine import batch, capture

AFTER = batch.sdpa_chunk_attention, batch.mask


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
    capture.sdpa_chunk_attention = attend  # what the packed step's attention hands a prompt chunk to


def model_report(model: str, args) -> dict:
    engine = bf16_engine(model)
    doc = bench_doc(engine, args.tokens)
    times = alternate(("before", "after"), use, {"s": lambda: prefill_s(engine, doc)}, args.reps, mirror=False)["s"]
    row = {}
    for way, seconds in times.items():
        use(way)
        ops = profiled(lambda: prefill_s(engine, doc), n=12)
        attention = sum(o["share"] for o in ops if "attention" in o["op"] or o["op"] in ("aten::where", "aten::le"))
        row[way] = {"prefill_s": round(statistics.median(seconds), 3), "runs_s": [round(s, 3) for s in seconds]}
        row[way] |= {
            "tokens_per_s": round(args.tokens / statistics.median(seconds)),
            "attention_share": round(attention, 3),
        }
        row[way]["top_ops"] = ops
    row["speedup"] = round(row["before"]["prefill_s"] / row["after"]["prefill_s"], 2)
    use("after")
    print(model, row["before"]["prefill_s"], "->", row["after"]["prefill_s"], "s", flush=True)
    return row


def main() -> None:
    args = options(__doc__, "models", "tokens", "reps", "threads", "out").parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "reps": args.reps, "dtype": "bfloat16"}
    report_models(args, report, model_report, show=False)


if __name__ == "__main__":
    main()
