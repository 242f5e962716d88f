"""One decode step before and after the one-token attention path (issue 27, item 2), side by
side in one run: bf16 sessions on a CPU whose one-token rows take torch's SDPA (before) or
``engine/batch.py``'s ``one_token_attention`` (after), at 1 and 8 sessions generating, each
on its own 2K-token cache; the operators a step spends its time in (torch.profiler), and one
2K prefill's, for both embedded models.

    .venv/bin/python bench/micro/one_token_attention_bench.py --out docs/results/decode_bench.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options
from harness.compare import report_models
from harness.engine import bench_doc, bf16_engine, prefill_s, profiled, sessions_on, step, step_ms, top_ops

from kvsnap.engine import Engine, batch

ONE_TOKEN_PAYS = batch._one_token_pays


def measure_steps(engine: Engine, sessions: list, steps: int) -> dict:
    ms = step_ms(engine, sessions, steps, warm=2)
    ops = profiled(lambda: step(engine, sessions))
    return {"step_ms": round(ms, 1), "tokens_per_s": round(len(sessions) * 1000 / ms, 1), "top_ops": ops}


def model_report(model: str, args) -> dict:
    engine = bf16_engine(model)
    doc = bench_doc(engine, args.tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        prefill_s(engine, doc)
    rows = {"prefill_2k": {"s": round(time.perf_counter() - began, 2), "top_ops": top_ops(prof)}}
    sessions = sessions_on(engine, doc, 8)
    for count in (1, 8):
        for label, pays in (("before_sdpa", lambda q: False), ("after", ONE_TOKEN_PAYS)):
            batch._one_token_pays = pays
            rows[f"{label}_{count}"] = measure_steps(engine, sessions[:count], args.steps)
        batch._one_token_pays = ONE_TOKEN_PAYS
        before, after = rows[f"before_sdpa_{count}"], rows[f"after_{count}"]
        rows[f"speedup_{count}"] = round(before["step_ms"] / after["step_ms"], 2)
        print(model, count, "sessions:", before["step_ms"], "->", after["step_ms"], "ms a step", flush=True)
    return rows


def main() -> None:
    args = options(__doc__, "models", "tokens", "steps", "threads", "out").parse_args()
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "dtype": "bfloat16", "torch": torch.__version__}
    report_models(args, report, model_report, show=False)


if __name__ == "__main__":
    main()
