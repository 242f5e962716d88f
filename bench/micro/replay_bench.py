"""A rebuild beside running streams: between steps (before) against in the batch (now), one run.

A replica that lost a session (evicted from every tier, moved without a hand-over, Redis wiped)
replays its log while other sessions stream their answers. Before 2026-12-06 the replay ran
whole between two of the scheduler's steps (``Scheduler.call(Engine.rebuild)``), so every
running stream stopped for its whole prefill; now it is a job of the batch (engine/replay.py),
a prompt chunk a step. Per round, alternating the two ways: --streams sessions decode
--decode-tokens each while one session of a --doc-tokens document and a question (two turns,
the model's default settings) is rebuilt; reported: the streams' longest gap between two tokens
while the rebuild ran, the rebuild's own seconds, and the whole round's; medians over --rounds,
and the ratios now / before. The rebuilt caches are checked equal to the lost one.

Usage: python bench/micro/replay_bench.py [--model smollm2-135m] [--out docs/results/replay_bench.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import options, write_json

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.defaults import default_settings
from kvsnap.engine.scheduler import Scheduler
from kvsnap.policies import make_policy
from kvsnap.tools.facts import facts_document


def lost_session(engine: Engine, model: str, doc_tokens: int):
    settings = default_settings(model)
    recompress, name = settings.pop("recompress"), settings.pop("policy")
    doc = facts_document(engine.tokenizer, target_tokens=doc_tokens, facts=2, seed=5)
    session = engine.new_session(make_policy(name, **settings), recompress)
    for i, fact in enumerate(doc.facts):
        text = f"{doc.document}\n\n{fact.question}" if i == 0 else fact.question
        engine.turn(session, engine.encode(text, first=i == 0), SamplingParams(max_new_tokens=16))
    return session, (lambda: engine.new_session(make_policy(name, **settings), recompress))


def one_round(engine: Engine, scheduler: Scheduler, lost, fresh, in_batch: bool, args) -> dict:
    sampling = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
    prompts = [engine.encode(f"Tell a long story about lighthouse keeper number {i}.") for i in range(args.streams)]
    jobs = [scheduler.submit(engine.start(engine.new_session("full"), p, sampling)) for p in prompts]
    stamps: list[list[float]] = [[] for _ in jobs]

    def read(i: int) -> None:
        for _ in jobs[i]:
            stamps[i].append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(jobs))]
    for r in readers:
        r.start()
    while min(len(s) for s in stamps) < 4:  # every stream is decoding
        time.sleep(0.005)
    session = fresh()
    t0 = time.perf_counter()
    if in_batch:
        for _ in scheduler.submit(engine.replaying(session, list(lost.transcript), lost.logical_len, list(lost.marks))):
            pass
    else:
        scheduler.call(engine.rebuild, session, list(lost.transcript), lost.logical_len, list(lost.marks))
    t1 = time.perf_counter()
    for r in readers:
        r.join()
    for a, b in zip(session.cache.layers, lost.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-2, atol=1e-2)  # batched: bf16 rounding apart
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b > t0 and a < t1]
    return {"max_gap_s": max(gaps), "rebuild_s": t1 - t0, "round_s": max(s[-1] for s in stamps) - t0}


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", doc_tokens=2350, streams=3, decode_tokens=96, rounds=4, threads=2)
    ap.add_argument("--out", default="docs/results/replay_bench.json")
    args = ap.parse_args()
    engine = Engine(load_model(args.model), prefill_chunk=1024)
    scheduler = Scheduler(engine, threading.RLock(), max_batch=16, threads=args.threads)
    lost, fresh = lost_session(engine, args.model, args.doc_tokens)
    runs = {"between_steps": [], "in_batch": []}
    try:
        for r in range(args.rounds):
            for way in ("between_steps", "in_batch") if r % 2 == 0 else ("in_batch", "between_steps"):
                runs[way].append(one_round(engine, scheduler, lost, fresh, way == "in_batch", args))
                print(way, {k: round(v, 3) for k, v in runs[way][-1].items()}, flush=True)
    finally:
        scheduler.stop()
    med = {way: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for way, rs in runs.items()}
    ratios = {k: round(med["in_batch"][k] / med["between_steps"][k], 2) for k in med["in_batch"]}
    out = {"args": vars(args), "rebuilt_tokens": len(lost.transcript), "median": med,
           "ratio_in_batch_over_between": ratios, "rounds": runs}  # fmt: skip
    print(json.dumps({"median": med, "ratios": ratios}, indent=1))
    write_json(args.out, out, indent=1)


if __name__ == "__main__":
    main()
