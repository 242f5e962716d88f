"""Two or more ways of running the same thing, measured side by side in one run: the ways take
turns (so that the machine's drifting speed falls on all alike), and each gets its medians; a
ratio says how much faster one is."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch

from harness.cli import step_options, write_json
from harness.engine import prefill_s, sessions_on, step_ms


def alternate(cases, use: Callable, measures: dict[str, Callable], reps: int, mirror: bool = True) -> dict:
    """Each of ``measures`` (a name -> a call that returns one sample) in each of ``cases``,
    ``use(case)`` switching to it, ``reps`` times: the cases in order, and with ``mirror`` in
    reverse order every other time (so that none always goes first). Per measure, per case, its
    samples."""
    cases = tuple(cases)
    samples: dict[str, dict[str, list]] = {key: {case: [] for case in cases} for key in measures}
    for rep in range(reps):
        for case in cases[::-1] if mirror and rep % 2 else cases:
            use(case)
            for key, measure in measures.items():
                samples[key][case].append(measure())
    return samples


def medians(samples: dict[str, list[float]], digits: int) -> dict[str, float]:
    """Each case's median, rounded to ``digits``."""
    return {case: round(statistics.median(s), digits) for case, s in samples.items()}


def speedup(row: dict, slow: str, fast: str, digits: int = 2) -> dict:
    """``row`` with its ``speedup``: ``slow``'s figure over ``fast``'s."""
    return row | {"speedup": round(row[slow] / row[fast], digits)}


def ab_medians(measures: dict[str, Callable], cases: tuple[str, str], use: Callable, reps: int) -> dict:
    """Each of ``measures`` in both ``cases`` (:func:`alternate`, mirrored): per measure the medians
    and the first case's over the second's."""
    samples = alternate(cases, use, measures, reps)
    return {key: speedup(medians(by_case, 2), *cases, digits=3) for key, by_case in samples.items()}


def side_by_side(model, measure: Callable, reps: int, toggle: tuple) -> dict:
    """``measure()`` with a change to ``model`` off and on, ``toggle`` = (off, on, their two
    labels), alternating in order: the medians and the ratio."""
    off, on, labels = toggle
    switch = dict(zip(labels, (off, on), strict=True))
    times = alternate(labels, lambda label: switch[label](model), {"s": measure}, reps, mirror=False)["s"]
    before, after = (statistics.median(times[label]) for label in labels)
    return {labels[0]: round(before, 3), labels[1]: round(after, 3), "speedup": round(before / after, 2)}


def steps_and_prefill(engine, doc: list[int], rows: dict, args, toggle: tuple) -> None:
    """Into ``rows``, :func:`side_by_side` under ``toggle``: the mean decode step of 1 and 8
    full-KV sessions on short (``args.short`` tokens) and long (``args.tokens``) caches, and one
    long prefill."""
    for label, length in (("short", args.short), ("long", args.tokens)):
        sessions = sessions_on(engine, doc[:length], 8)
        for count in (1, 8):
            key = f"decode_ms_{count}_{label}"
            steps = lambda s=sessions[:count]: step_ms(engine, s, args.steps)  # noqa: E731
            rows[key] = side_by_side(engine.model, steps, args.reps, toggle)
            print(engine.loaded.name, key, rows[key], flush=True)
    rows["prefill_s_long"] = side_by_side(engine.model, lambda: prefill_s(engine, doc), args.reps, toggle)
    print(engine.loaded.name, "prefill_s_long", rows["prefill_s_long"], flush=True)


def report_models(args, report: dict, model_report: Callable, indent: int = 2, show: bool = True) -> dict:
    """``model_report(name, args)`` for each of ``--models`` into ``report`` (with ``show``, each
    printed), written to ``--out`` (if given)."""
    for name in args.models.split(","):
        report[name] = model_report(name, args)
        if show:
            print(name, json.dumps(report[name]), flush=True)
    write_json(args.out, report, indent)
    return report


def decode_step_main(doc: str, model_report: Callable, *, needs=None, why="", indent=2, show=True, **header) -> dict:
    """The decode-step benchmark ``doc`` describes: its options (:func:`step_options`), torch's
    threads, then (unless ``needs()`` says no: it exits with ``why``) :func:`report_models` into
    a report of its sessions, threads and reps, and ``header``."""
    args = step_options(doc).parse_args()
    torch.set_num_threads(args.threads)
    if needs is not None and not needs():
        raise SystemExit(why)
    report = {"sessions": args.sessions, "threads": args.threads, "reps": args.reps} | header
    return report_models(args, report, model_report, indent, show)
