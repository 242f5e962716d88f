"""A bf16 decode step's Python and operator overhead, cut by cut, side by side in one run.

In-process ``Engine``, bfloat16 (packed weights, fused norms and activations, the attention
kernels), both embedded models; three cases, alternating --reps times (medians):

- ``operators``: every row's append and attention as torch operators per row and layer, and
  transformers' decoder layers (what a step ran before these cuts);
- ``c_rows``: one-token rows appended and attended by one C call per layer (engine/decode_rows.py);
- ``c_rows_lean``: that, and Llama-family layers without transformers' module calls
  (engine/lean.py; SmolLM2 only: Gemma 3 keeps transformers' layers, so its two last cases
  are the same code).

Each gives the mean decode step of --sessions full-KV sessions on short (--short tokens) and
long (--tokens) caches, and one --tokens prefill. Every case computes the same bits
(tests/test_decode_rows.py, tests/test_lean.py); this measures the time.

    .venv/bin/python bench/step_bench.py --out docs/results/step_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from decode_bench import prefill_s, sessions_on, step_ms
from dtype_bench import DOC

from kvsnap.engine import Engine, batch, lean, load_model

FAST = batch.BatchCache._fast_rows
CASES = ("operators", "c_rows", "c_rows_lean")


def use(case: str, model: torch.nn.Module) -> None:
    batch.BatchCache._fast_rows = FAST if case != "operators" else (lambda self, *a: [])
    (lean.install if case == "c_rows_lean" else lean.uninstall)(model)


def by_case(model: torch.nn.Module, measure, reps: int, digits: int) -> dict[str, float]:
    """``measure()`` in every case, the cases alternating in order and reverse ``reps`` times; medians."""
    times: dict[str, list] = {case: [] for case in CASES}
    for rep in range(reps):
        for case in CASES if rep % 2 == 0 else CASES[::-1]:
            use(case, model)
            times[case].append(measure())
    return {case: round(statistics.median(t), digits) for case, t in times.items()}


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a decode-step benchmark (this one, bench/amx_linear_bench.py)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--short", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    return parser


def main() -> None:
    args = step_parser(__doc__).parse_args()
    torch.set_num_threads(args.threads)
    report = {"sessions": args.sessions, "threads": args.threads, "reps": args.reps, "dtype": "bfloat16"}
    for name in args.models.split(","):
        engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
        doc = engine.encode(DOC)
        rows = {}
        for label, length in (("short", args.short), ("long", args.tokens)):
            sessions = sessions_on(engine, doc[:length], args.sessions)
            steps = by_case(engine.model, lambda e=engine, s=sessions: step_ms(e, s, args.steps), args.reps, 1)
            rows[f"decode_ms_{label}_{length}"] = steps
            print(name, label, steps, flush=True)
        prefill = by_case(engine.model, lambda e=engine, d=doc[: args.tokens]: prefill_s(e, d), args.reps, 3)
        rows[f"prefill_s_{args.tokens}"] = prefill
        print(name, "prefill", prefill, flush=True)
        for key, got in list(rows.items()):
            rows[key]["speedup"] = round(got["operators"] / got["c_rows_lean"], 3)
        use("c_rows_lean", engine.model)
        report[name] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
