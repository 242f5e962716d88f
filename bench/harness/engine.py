"""The in-process ``Engine`` helpers the micro benchmarks share: the bench document, full-KV
sessions with an answer's token pending, timed decode steps and prefills, and the operators a
profiled call spent its time in."""

from __future__ import annotations

import statistics
import time

import torch

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.policies import make_policy

# plain notes, long enough for --tokens 2048 on both embedded models
DOC = " ".join(f"Note {i}: the shipment for depot {i} left on time and arrived the next morning." for i in range(200))


def bf16_engine(model: str, threads: int | None = None, **engine_args) -> Engine:
    """``model`` in bfloat16 on an ``Engine`` with prompt chunks of 1,024 (what a replica runs);
    with ``threads``, torch's threads set first."""
    if threads is not None:
        torch.set_num_threads(threads)
    return Engine(load_model(model, dtype="bfloat16"), prefill_chunk=1024, **engine_args)


def bench_doc(engine: Engine, tokens: int, warm: bool = True) -> list[int]:
    """The first ``tokens`` tokens of :data:`DOC`; with ``warm``, after an untimed 256-token prefill."""
    doc = engine.encode(DOC)[:tokens]
    if warm:
        prefill_s(engine, doc[:256])  # warm-up
    return doc


def sessions_on(engine: Engine, doc: list[int], count: int) -> list:
    """``count`` full-KV sessions on ``doc``, each with its answer's first token pending."""
    out = []
    for _ in range(count):
        session = engine.new_session(make_policy("full"))
        engine.turn(session, doc, SamplingParams(max_new_tokens=1))  # its answer's token is pending
        out.append(session)
    return out


def step_measures(engine: Engine, args) -> dict:
    """The mean decode step of ``args.sessions`` full-KV sessions on short (``args.short``
    tokens) and long (``args.tokens``) caches of :data:`DOC` (``args.steps`` steps each), as
    measures to alternate (:func:`harness.compare.alternate`), ms."""
    doc, measures = engine.encode(DOC), {}
    for label, length in (("short", args.short), ("long", args.tokens)):
        sessions = sessions_on(engine, doc[:length], args.sessions)
        measures[f"decode_step_ms_{label}_{length}"] = lambda s=sessions: step_ms(engine, s, args.steps)
    return measures


def step(engine: Engine, sessions: list) -> None:
    """One greedy decode step of ``sessions`` (each gets its token)."""
    logits = engine.decode_step(sessions, greedy=True)
    for session, row in zip(sessions, logits, strict=True):
        session.transcript.append(int(row.argmax()))


def step_ms(engine: Engine, sessions: list, steps: int, warm: int = 1) -> float:
    """The mean time of ``steps`` decode steps of ``sessions`` (after ``warm`` untimed ones), ms."""
    for _ in range(warm):
        step(engine, sessions)
    began = time.perf_counter()
    for _ in range(steps):
        step(engine, sessions)
    return (time.perf_counter() - began) / steps * 1000


def prefill_s(engine: Engine, doc: list[int]) -> float:
    """One full-KV session's prefill of ``doc``, seconds."""
    began = time.perf_counter()
    engine.prefill(engine.new_session(make_policy("full")), doc)
    return time.perf_counter() - began


def seconds(fn, reps: int, warm: int = 0) -> list[float]:
    """The seconds of each of ``reps`` calls of ``fn`` (after ``warm`` untimed ones)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


def best(fn, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn``, seconds."""
    return min(seconds(fn, reps))


def median_ms(fn, reps: int) -> float:
    """The median of ``reps`` calls of ``fn`` after one untimed, ms."""
    return statistics.median(seconds(fn, reps, warm=1)) * 1000


def timed_ms(fn, calls: int = 5) -> float:
    """The mean of ``calls`` calls of ``fn`` after one untimed, ms."""
    fn()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1000


def top_ops(prof, n: int = 6) -> list[dict]:
    """The ``n`` operators a ``torch.profiler`` run spent most self CPU time in: share, calls."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
    return [{"op": e.key, "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in rows]


def profiled(fn, n: int = 6) -> list[dict]:
    """One call of ``fn`` under ``torch.profiler``: its ``n`` top operators (:func:`top_ops`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return top_ops(prof, n)
