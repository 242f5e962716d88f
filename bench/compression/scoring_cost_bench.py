"""What query-agnostic scoring costs at prefill, in one run: a document prefilled and
compressed under ``full``, ``snapkv``, ``kvzap`` (linear and MLP surrogates) and ``kvzip``,
the policies interleaved within every repetition so that the machine's noise hits all alike.

Per policy and length: median prefill time (the forward passes, plus scoring and selection)
and its overhead over ``full`` as a share of full's prefill time; for ``kvzip`` its scratch
reconstruction pass is most of that.

Usage: python bench/compression/scoring_cost_bench.py [--model gemma3-270m] [--lengths 1024,2048,4096] [--reps 3]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import DOCS_RESULTS, options, write_json

from kvsnap.engine import Engine, load_model
from kvsnap.engine.turn import Timer
from kvsnap.policies import make_policy
from kvsnap.tools.tasks import multi_key_prompt

POLICIES = {
    "full": {"name": "full"},
    "snapkv:r0.33": {"name": "snapkv", "ratio": 0.33, "window": 32},
    "kvzap-linear:r0.33": {"name": "kvzap", "ratio": 0.33, "window": 32, "surrogate": "linear"},
    "kvzap-mlp:r0.33": {"name": "kvzap", "ratio": 0.33, "window": 32, "surrogate": "mlp"},
    "kvzip:r0.33": {"name": "kvzip", "ratio": 0.33, "window": 32},
}


def main() -> None:
    args = options(__doc__, "model", "reps", "out", lengths="1024,2048,4096", whole_doc=True).parse_args()
    engine = Engine(load_model(args.model), prefill_chunk=512)
    lengths = [int(x) for x in args.lengths.split(",")]
    times: dict = {(p, n): [] for p in POLICIES for n in lengths}
    for n in lengths:
        doc = engine.encode(multi_key_prompt(engine.tokenizer, n, keys=4, seed=n).document)
        for rep in range(args.reps + 1):  # the first repetition warms up (not counted)
            for name, spec in POLICIES.items():
                params = {k: v for k, v in spec.items() if k != "name"}
                session = engine.new_session(make_policy(spec["name"], **params))
                timer = Timer()
                t0 = time.perf_counter()
                engine.prefill(session, doc, timer)
                if rep:
                    times[(name, n)].append(time.perf_counter() - t0)
    rows = []
    for n in lengths:
        full = statistics.median(times[("full", n)])
        for name in POLICIES:
            t = statistics.median(times[(name, n)])
            rows.append({"policy": name, "tokens": n, "prefill_s": t, "overhead": (t - full) / full})
    samples = {f"{p}@{n}": v for (p, n), v in times.items()}
    out = write_json(
        args.out or DOCS_RESULTS / f"scored_bench_{args.model}.json",
        {"args": vars(args), "rows": rows, "samples": samples},
    )
    print(f"{args.model}: prefill time, median of {args.reps}, and the overhead over full")
    print("| policy | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name in POLICIES:
        cells = [next(r for r in rows if r["policy"] == name and r["tokens"] == n) for n in lengths]
        print(f"| {name} | " + " | ".join(f"{c['prefill_s']:.2f} s ({c['overhead']:+.1%})" for c in cells) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
