"""A decode step's products on AMX tiles against oneDNN's, side by side in one run.

In-process ``Engine``, bfloat16 (packed weights, fused kernels, attention kernels: what a
replica runs), both embedded models. Two cases, alternating --reps times (medians):

- ``onednn``: every projection with a few rows through oneDNN's packed weights, the LM head's
  first pass through ``F.linear`` (what a decode step ran before engine/amx_linear.py);
- ``amx``: those products on the AMX tiles.

Each gives: all of the model's projections at 8 rows, once each (the products alone), the LM
head's first pass at 8 rows, and the mean decode step of --sessions full-KV sessions on short
(--short tokens) and long (--tokens) caches. Both cases compute the same bits
(tests/test_amx_linear.py); this measures the time.

    .venv/bin/python bench/amx_linear_bench.py --out docs/results/amx_linear_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from decode_bench import sessions_on, step_ms
from dtype_bench import DOC
from step_bench import step_parser
from torch import nn

from kvsnap.engine import Engine, amx_linear, load_model, packed

CASES = ("onednn", "amx")


def use(case: str, engine: Engine) -> None:
    packed.AMX_MAX_ROWS = amx_linear.MAX_ROWS if case == "amx" else 0
    engine.head.tiles = case == "amx" and amx_linear.takes(engine.head.weight_bf16)


def timed_ms(fn, calls: int = 5) -> float:
    fn()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1000


def model_report(name: str, args: argparse.Namespace) -> dict:
    engine = Engine(load_model(name, dtype="bfloat16"), prefill_chunk=1024)
    linears = [m for m in engine.model.modules() if type(m) is nn.Linear and packed.uses_amx(m)]
    rows = {k: torch.randn(args.sessions, k).to(torch.bfloat16) for k in {m.in_features for m in linears}}
    hidden = torch.randn(args.sessions, engine.head.weight_bf16.shape[1]).to(torch.bfloat16)
    doc = engine.encode(DOC)
    measures = {
        "projections_ms": lambda: timed_ms(lambda: [m(rows[m.in_features]) for m in linears]),
        "head_first_pass_ms": lambda: timed_ms(lambda: engine.head._first_pass(hidden)),
    }
    for label, length in (("short", args.short), ("long", args.tokens)):
        sessions = sessions_on(engine, doc[:length], args.sessions)
        measures[f"decode_step_ms_{label}_{length}"] = lambda s=sessions: step_ms(engine, s, args.steps)
    result = {"projections": len(linears), "projection_mb": round(sum(m.weight.nbytes for m in linears) / 1e6, 1)}
    result |= alternating(measures, CASES, lambda case: use(case, engine), args.reps)
    use("amx", engine)
    return result


def alternating(measures: dict, cases: tuple[str, str], use, reps: int) -> dict:
    """Each of ``measures`` in both ``cases`` (``use(case)`` switches), the cases alternating in
    order and reverse ``reps`` times: per measure the medians and the first case's over the second's."""
    times = {key: {case: [] for case in cases} for key in measures}
    for rep in range(reps):
        for case in cases if rep % 2 == 0 else cases[::-1]:
            use(case)
            for key, measure in measures.items():
                times[key][case].append(measure())
    result = {}
    for key, by_case in times.items():
        medians = {case: round(statistics.median(t), 2) for case, t in by_case.items()}
        result[key] = medians | {"speedup": round(medians[cases[0]] / medians[cases[1]], 3)}
    return result


def report_models(args, report: dict, model_report) -> None:
    """``model_report(name, args)`` for each of ``--models``, printed, into ``report``, written to ``--out``."""
    for name in args.models.split(","):
        report[name] = model_report(name, args)
        print(name, json.dumps(report[name]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    args = step_parser(__doc__).parse_args()
    torch.set_num_threads(args.threads)
    if amx_linear.kernel() is None:
        raise SystemExit("no AMX kernel on this machine: nothing to compare")
    report = {"sessions": args.sessions, "reps": args.reps, "threads": args.threads, "dtype": "bfloat16"}
    report_models(args, report, model_report)


if __name__ == "__main__":
    main()
