"""The greedy head (engine/models/head.py) against the fp32 head, side by side in one run, on the engine
alone: one decode step over B sessions, each holding a compressed --context-token document.

Two engines share one loaded model: one with the greedy screen, one without (fp32 head for
every row). Per batch size B (--batches), the two take turns, --reps steps each, on the same
B sessions (each step appends one token to every session, as decoding does); the medians and
their ratio are printed and written. Also per B: the screen's candidates per row (how many
tokens the float64 recompute had to look at). That both heads pick the same tokens is
tests/engine/models/test_lm_head.py's and tests/engine/test_continuous_batching.py's to show.

Usage: python bench/micro/greedy_head_bench.py [--model gemma3-270m] [--context 2048] [--batches 1,2,4,8,16]
       [--reps 7] [--out docs/results/head_bench.json]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, options, started, write_json

from kvsnap.engine import Engine, load_model
from kvsnap.engine.models.head import SCREEN_MIN_ROWS
from kvsnap.tools.loadgen import document

SCRIPT = "bench/micro/greedy_head_bench.py"


def main() -> None:
    ap = options(__doc__, "model", context=2048, batches="1,2,4,8,16", reps=7, threads=2, whole_doc=True)
    ap.add_argument("--out", default=str(RESULTS / "head_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    began = started()
    batches = [int(b) for b in args.batches.split(",")]
    loaded = load_model(args.model)
    engines = {"screen": Engine(loaded, greedy_screen=True), "fp32": Engine(loaded, greedy_screen=False)}
    engine = engines["screen"]
    sessions = []
    for i in range(max(batches)):
        session = engine.new_session("snapkv")
        engine.prefill(session, engine.encode(document(loaded.tokenizer, args.context, i)))
        sessions.append(session)

    candidates: list[int] = []
    found = engine.head._candidates

    def counting(*a):
        rows, cols = found(*a)
        if rows is not None:
            candidates.extend(torch.bincount(rows).tolist())
        return rows, cols

    engine.head._candidates = counting
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {"screen": [], "fp32": []}
        candidates.clear()
        for _ in range(args.reps):
            for name, eng in engines.items():  # interleaved: the machine's noise hits both
                for s in sessions[:b]:
                    s.transcript.append(1234)  # one pending token each, as after a decode step
                t0 = time.perf_counter()
                eng.decode_step(sessions[:b], greedy=True)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "batch": b,
                "first_pass": "bf16" if b >= SCREEN_MIN_ROWS else "fp32",
                "step_ms_screen": med["screen"] * 1e3,
                "step_ms_fp32": med["fp32"] * 1e3,
                "speedup": med["fp32"] / med["screen"],
                "candidates_per_row_median": statistics.median(candidates) if candidates else None,
                "candidates_per_row_max": max(candidates) if candidates else None,
            }
        )
    base = {name: rows[0][f"step_ms_{name}"] / rows[0]["batch"] for name in ("screen", "fp32")}
    for row in rows:  # tokens/s at B over tokens/s at the first batch size, per head
        for name in ("screen", "fp32"):
            row[f"batch_gain_{name}"] = base[name] * row["batch"] / row[f"step_ms_{name}"]
    result = {
        "command": f"python {SCRIPT} " + " ".join(f"--{k}={v}" for k, v in vars(args).items() if k != "out"),
        "started": began,
        "rows": rows,
    }
    out = write_json(args.out, result)
    header = f"{'B':>3} {'pass':>5} {'screen ms':>10} {'fp32 ms':>8} {'speedup':>8} {'gain s/f':>12}"
    print(header + f" {'cands med/max':>14}")
    for r in rows:
        print(
            f"{r['batch']:>3} {r['first_pass']:>5} {r['step_ms_screen']:>10.1f} {r['step_ms_fp32']:>8.1f} "
            f"{r['speedup']:>7.2f}x {r['batch_gain_screen']:>5.2f}/{r['batch_gain_fp32']:<5.2f} "
            f"{r['candidates_per_row_median']!s:>6}/{r['candidates_per_row_max']!s:<7}"
        )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
