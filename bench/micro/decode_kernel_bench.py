"""One decode step with and without the one-token attention kernel (cpu_kernels/decode_attention.py), side by
side in one run: bf16 full-KV sessions on their own ``--tokens``-row caches, 1 and 8 generating,
both embedded models; each case alternates with the other ``--runs`` times (medians), and one
more step of each under torch.profiler gives its top operators (self CPU time).

    .venv/bin/python bench/micro/decode_kernel_bench.py --out docs/results/kernel_bench.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options
from harness.compare import alternate, report_models
from harness.engine import DOC, profiled, sessions_on, step, step_ms

from kvsnap.cpu_kernels import decode_attention
from kvsnap.engine import Engine, load_model

KERNEL = decode_attention.available


def use_kernel(on: bool) -> None:
    decode_attention.available = KERNEL if on else (lambda: False)


def model_report(model: str, args) -> dict:
    engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
    sessions = sessions_on(engine, engine.encode(DOC)[: args.tokens], 8)
    rows = {}
    for count in (1, 8):
        steps = {"ms": lambda s=sessions[:count]: step_ms(engine, s, args.steps)}
        times = alternate(("torch", "kernel"), lambda label: use_kernel(label == "kernel"), steps, args.runs, False)
        case = {}
        for label, ms in times["ms"].items():
            use_kernel(label == "kernel")
            median = statistics.median(ms)
            case[label] = {"step_ms": round(median, 1), "tokens_per_s": round(count * 1000 / median, 1)}
            case[label]["top_ops"] = profiled(lambda s=sessions[:count]: step(engine, s))
        case["speedup"] = round(case["torch"]["step_ms"] / case["kernel"]["step_ms"], 2)
        rows[f"sessions_{count}"] = case
        before, after = case["torch"]["step_ms"], case["kernel"]["step_ms"]
        print(model, count, "sessions:", before, "->", after, "ms a step", flush=True)
    use_kernel(True)
    return rows


def main() -> None:
    args = options(__doc__, "models", "tokens", "threads", "out", steps=6, runs=3).parse_args()
    if KERNEL() is None:
        raise SystemExit("the kernel is not available here (no C compiler, or KVSNAP_C_KERNELS=0)")
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "runs": args.runs, "dtype": "bfloat16"}
    report_models(args, report, model_report, show=False)


if __name__ == "__main__":
    main()
