"""One decode step with and without the one-token attention kernel (engine/kernels.py), side by
side in one run: bf16 full-KV sessions on their own ``--tokens``-row caches, 1 and 8 generating,
both embedded models; each case alternates with the other ``--runs`` times (medians), and one
more step of each under torch.profiler gives its top operators (self CPU time).

    .venv/bin/python bench/kernel_bench.py --out docs/results/kernel_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from decode_bench import sessions_on, step, step_ms, top_ops
from dtype_bench import DOC
from torch.profiler import ProfilerActivity, profile

from kvsnap.engine import Engine, kernels, load_model

KERNEL = kernels.kernel


def use_kernel(on: bool) -> None:
    kernels.kernel = KERNEL if on else (lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if KERNEL() is None:
        raise SystemExit("the kernel is not available here (no C compiler, or KVSNAP_C_KERNELS=0)")
    torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "threads": args.threads, "runs": args.runs, "dtype": "bfloat16"}
    for model in args.models.split(","):
        engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024)
        sessions = sessions_on(engine, engine.encode(DOC)[: args.tokens], 8)
        rows = {}
        for count in (1, 8):
            times = {"torch": [], "kernel": []}
            for _ in range(args.runs):
                for label in times:
                    use_kernel(label == "kernel")
                    times[label].append(step_ms(engine, sessions[:count], args.steps))
            case = {}
            for label, ms in times.items():
                use_kernel(label == "kernel")
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step(engine, sessions[:count])
                median = statistics.median(ms)
                case[label] = {"step_ms": round(median, 1), "tokens_per_s": round(count * 1000 / median, 1)}
                case[label]["top_ops"] = top_ops(prof)
            case["speedup"] = round(case["torch"]["step_ms"] / case["kernel"]["step_ms"], 2)
            rows[f"sessions_{count}"] = case
            before, after = case["torch"]["step_ms"], case["kernel"]["step_ms"]
            print(model, count, "sessions:", before, "->", after, "ms a step", flush=True)
        use_kernel(True)
        report[model] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
