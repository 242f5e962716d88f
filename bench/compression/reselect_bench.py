"""Per-turn re-selection benchmark (recompress="reselect"), measured side by side in one run.

At each --lengths, on the embedded model, one follow-up turn (a question, --new-tokens
generated) on:
  1. plain SnapKV (recompress="per_turn": re-selects from the rows it kept)
  2. reselect    (recompress="reselect": re-scores the full cache kept in host memory)
  3. re-prefill  (what a stateless server does: the whole transcript again, then the answer)
Reports turn latency and TTFT (median of --reps, interleaved), the share of the reselect
turn spent re-selecting, and the bytes held: device KV (equal for 1 and 2) and the host copy.

Usage: python bench/compression/reselect_bench.py [--lengths 2048,4096] [--budget 256] [--reps 3]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import DOCS_RESULTS, options, write_json

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.policies import make_policy
from kvsnap.tools.tasks import multi_key_prompt


def main() -> None:
    ap = options(__doc__, "model", lengths="2048,4096", budget=256, window=32, new_tokens=8, reps=3)
    ap.add_argument("--out", default=str(DOCS_RESULTS))
    args = ap.parse_args()

    engine = Engine(load_model(args.model), prefill_chunk=1024)
    policy = make_policy("snapkv", budget=args.budget, window=args.window)
    sampling = SamplingParams(max_new_tokens=args.new_tokens)
    rows = {}
    for length in (int(x) for x in args.lengths.split(",")):
        task = multi_key_prompt(engine.tokenizer, target_tokens=length, keys=4, seed=length)
        first = engine.encode(task.document + task.question(0))
        sessions = {mode: engine.new_session(policy, recompress=mode) for mode in ("per_turn", "reselect")}
        for s in sessions.values():
            engine.turn(s, first, sampling)
        times = {k: [] for k in ("per_turn", "reselect", "reprefill", "reselect_share")}
        ttft = {k: [] for k in ("per_turn", "reselect", "reprefill")}
        for rep in range(args.reps):  # interleaved
            question = engine.encode(task.question(1 + rep % 3), first=False)
            transcript = sessions["per_turn"].transcript + question  # what a stateless server re-prefills
            for mode, s in sessions.items():
                t0 = time.perf_counter()
                r = engine.turn(s, question, sampling).report
                times[mode].append(time.perf_counter() - t0)
                ttft[mode].append(r.ttft_s)
                if mode == "reselect":
                    times["reselect_share"].append(r.reselect_s / times[mode][-1])
            stateless = engine.new_session(policy)
            t0 = time.perf_counter()
            r = engine.turn(stateless, transcript, sampling).report
            times["reprefill"].append(time.perf_counter() - t0)
            ttft["reprefill"].append(r.ttft_s)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows[length] = {
            "context_tokens": sessions["reselect"].logical_len,
            "turn_s": {k: med[k] for k in ("per_turn", "reselect", "reprefill")},
            "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
            "reselect_share": med["reselect_share"],
            "device_kv_bytes": {k: s.kv_bytes for k, s in sessions.items()},
            "host_full_copy_bytes": sessions["reselect"].full_copy_bytes,
            "samples": times,
        }
        print(f"L={length} done: {json.dumps(rows[length]['turn_s'])}", flush=True)

    out = Path(args.out)
    write_json(out / "reselect_bench.json", {"args": vars(args), "rows": rows}, indent=1)
    print(
        f"\n{args.model}, SnapKV budget {args.budget}, follow-up turn ({args.new_tokens} tokens), median of {args.reps}"
    )
    print(
        f"{'context':>8} {'SnapKV ms':>10} {'reselect ms':>12} {'(re-select)':>12} {'re-prefill ms':>14} "
        f"{'device MiB':>11} {'host copy MiB':>14}"
    )
    for r in rows.values():
        t = r["turn_s"]
        print(
            f"{r['context_tokens']:>8} {t['per_turn'] * 1e3:>10.1f} {t['reselect'] * 1e3:>12.1f} "
            f"{r['reselect_share']:>11.1%} {t['reprefill'] * 1e3:>14.1f} "
            f"{r['device_kv_bytes']['reselect'] / 2**20:>11.2f} {r['host_full_copy_bytes'] / 2**20:>14.2f}"
        )
    plot(rows, out / "reselect_bench.png")
    print(f"wrote {out / 'reselect_bench.json'} and {out / 'reselect_bench.png'}")


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = [f"{r['context_tokens']} tokens" for r in rows.values()]
    for n, (mode, name) in enumerate((("per_turn", "SnapKV"), ("reselect", "reselect"), ("reprefill", "re-prefill"))):
        xs = [i + (n - 1) * 0.27 for i in range(len(rows))]
        ax.bar(xs, [r["turn_s"][mode] * 1e3 for r in rows.values()], width=0.27, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set(ylabel="follow-up turn ms", yscale="log", title="per-turn re-selection cost")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
