"""``kvsnap calibrate``: a model's session defaults, chosen by measurement against full KV.

Runs the fact sweep (``kvsnap eval --tasks facts``: documents of varied prose stating facts once,
asked one per turn over the chat template, in-process, greedy) on the model with full KV and
with each candidate: SnapKV keeping a share of each layer's rows (sentence spans, a floor of
512 rows) at every share of ``--ratios``, KVzap at the same shares where a surrogate for
the model ships, and mixed precision: SnapKV keeping each share of ``--mixed-ratios`` at the
cache's precision and the other rows at each of ``--bits`` (engine/cold.py). The default is
the candidate that holds the fewest bytes (measured: what the session holds after each turn,
over full KV's) while its first questions answer at least
``--turn1`` x what full KV answers and its follow-ups at least ``--follow-ups`` x; full KV
where none does. The result, with the whole table, goes where the engine finds it
(engine/defaults.py: :func:`~kvsnap.engine.defaults.calibrated_path`); ``kvsnap serve``
then gives the model these defaults and says so at start-up.
"""

from __future__ import annotations

import json
import sys
import time

from .clients import DTYPES, csv

FLOOR = 512  # the floor of every candidate share (engine/defaults.py's FLOOR)


def candidates(
    model: str, ratios: tuple[float, ...], mixed: tuple[float, ...] = (), bits: tuple[int, ...] = ()
) -> list[str]:
    """Full KV and the policy specs swept on ``model``: SnapKV at each share, KVzap at each
    where a surrogate for the model ships, and SnapKV at each ``mixed`` share with the rest of
    the rows at each of ``bits`` (no floor: the rows left out are not lost)."""
    from kvsnap.policies.kvzap import weights_path

    policies = ["snapkv"]
    try:
        if weights_path(model, "linear").is_file():
            policies.append("kvzap")
    except Exception:  # noqa: BLE001 - a name no surrogate file can have: no KVzap candidates
        pass
    evicting = [f"{p}:r{r:g}/f{FLOOR}/s" for p in policies for r in sorted(ratios)]
    return ["full", *evicting, *(f"snapkv:r{r:g}/s/q{b}" for b in sorted(bits) for r in sorted(mixed))]


def choose(summary: dict, turn1: float, follow_ups: float) -> tuple[str, list[dict]]:
    """The candidate of ``summary`` (the facts task's per-policy summary) that holds the fewest
    bytes while it answers at least ``turn1`` x full KV's first questions and ``follow_ups`` x
    its follow-ups (``full`` where none does), and every candidate's row of the table."""
    full = summary["full"]
    rows = []
    for spec, got in summary.items():
        row = {
            "policy": spec,
            "turn1": got["per_turn"]["1"],
            "follow_ups": got["follow_up_accuracy"],
            "bytes_x_full": got["held_bytes_mean"] / got["full_kv_bytes_mean"],
        }
        row["holds"] = (
            row["turn1"] >= turn1 * full["per_turn"]["1"]
            and row["follow_ups"] >= follow_ups * full["follow_up_accuracy"]
        )
        rows.append(row)
    holding = [r for r in rows if r["holds"]]
    best = min(holding, key=lambda r: (r["bytes_x_full"], r["policy"] != "full"))["policy"] if holding else "full"
    return best, sorted(rows, key=lambda r: r["bytes_x_full"])


def check_args(args) -> None:
    """Clear errors for settings no sweep can run, before the model loads."""
    if not args.ratios or any(not 0.0 < r < 1.0 for r in args.ratios):
        raise SystemExit("kvsnap calibrate: --ratios must be shares in (0, 1), e.g. 0.25,0.5,0.75")
    if not (0.0 <= args.turn1 <= 1.0 and 0.0 <= args.follow_ups <= 1.0):
        raise SystemExit("kvsnap calibrate: --turn1 and --follow-ups must lie in [0, 1]")
    if any(not 0.0 < r < 1.0 for r in args.mixed_ratios) or any(b not in (2, 4) for b in args.bits):
        raise SystemExit("kvsnap calibrate: --mixed-ratios must be shares in (0, 1), --bits 2 and/or 4")
    if not args.lengths or min(args.lengths) < 256 or args.seeds < 1 or not 2 <= args.keys <= 8:
        raise SystemExit("kvsnap calibrate: --lengths of at least 256 tokens, --seeds >= 1, --keys in [2, 8]")


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from kvsnap.engine import Engine, load_model
    from kvsnap.engine.defaults import calibrated_path
    from kvsnap.tools import quality
    from kvsnap.tools.specs import PolicySpec

    check_args(args)
    print(f"loading model {args.model!r}...", file=sys.stderr, flush=True)
    engine = Engine(load_model(args.model, dtype=args.dtype))
    specs = candidates(args.model, tuple(args.ratios), tuple(args.mixed_ratios), tuple(args.bits))
    spec = quality.EvalSpec(tasks=("facts",), lengths=tuple(args.lengths), policies=tuple(specs), keys=args.keys,
                            seeds=args.seeds)  # fmt: skip
    cases = quality.build_cases(engine.tokenizer, spec)
    print(f"{len(cases)} documents x {len(specs)} settings ({', '.join(specs)})", file=sys.stderr, flush=True)
    started = time.perf_counter()
    scores = quality.evaluate(quality.InProcess(engine), cases, spec, progress=lambda m: print(m, file=sys.stderr))
    summary = quality.summarize(scores)["facts"]
    best, table = choose(summary, args.turn1, args.follow_ups)
    settings = PolicySpec.parse(best).settings(spec.window)
    settings.pop("recompress", None)  # per turn, the engine's default
    result = {
        "model": args.model,
        "weights": engine.loaded.weights,  # the weights measured (a folder's name may later hold others)
        "settings": settings,
        "policy": best,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "command": "kvsnap " + " ".join(sys.argv[1:]),
        "thresholds": {"turn1": args.turn1, "follow_ups": args.follow_ups},
        "sweep": {"lengths": args.lengths, "seeds": args.seeds, "keys": args.keys, "dtype": str(engine.model.dtype)},
        "elapsed_s": round(time.perf_counter() - started, 1),
        "table": table,
    }
    print(format_table(result))
    path = Path(args.out) if args.out else calibrated_path(args.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\ndefaults for {args.model}: {best}; wrote {path}")
    return 0


def format_table(result: dict) -> str:
    """The sweep as a markdown table, the chosen setting marked."""
    lines = ["| setting | first questions | follow-ups | KV held, x full KV | holds |", "|---|---|---|---|---|"]
    for r in result["table"]:
        mark = " (default)" if r["policy"] == result["policy"] else ""
        lines.append(f"| `{r['policy']}`{mark} | {r['turn1']:.2f} | {r['follow_ups']:.2f} | "
                     f"{r['bytes_x_full']:.2f} | {'yes' if r['holds'] else 'no'} |")  # fmt: skip
    return "\n".join(lines)


def add_calibrate_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="a model's session defaults, by the fact sweep against full KV")
    cal.add_argument("--model", required=True, help="an embedded model's name, an HF id or a folder")
    cal.add_argument("--dtype", default=None, choices=DTYPES, help="default auto: the device's fast one")
    cal.add_argument("--lengths", type=csv(int), default=[2048, 4096], help="document tokens (default 2048,4096)")
    cal.add_argument("--seeds", type=int, default=6, help="documents per length (default 6)")
    cal.add_argument("--keys", type=int, default=4, help="facts per document, one asked per turn (default 4)")
    cal.add_argument("--ratios", type=csv(float), default=[0.25, 0.5, 0.75, 0.875],
                     help="the shares of rows swept (default 0.25,0.5,0.75,0.875)")  # fmt: skip
    cal.add_argument(
        "--mixed-ratios",
        type=csv(float),
        default=[0.0625, 0.125, 0.25],
        help="mixed precision: the shares kept at the cache's precision (default 0.0625,0.125,0.25)",
    )
    cal.add_argument("--bits", type=csv(int), default=[4, 2], help="mixed precision: the rest's bits (default 4,2)")
    cal.add_argument("--turn1", type=float, default=0.95, help="first questions, at least this x full KV's")
    cal.add_argument("--follow-ups", type=float, default=0.9, help="follow-ups, at least this x full KV's")
    cal.add_argument("--out", default=None, help="the result's file (default: where the engine finds it)")
    cal.set_defaults(func=cmd_calibrate)
