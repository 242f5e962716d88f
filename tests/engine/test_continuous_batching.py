"""Continuous batching (engine/scheduler.py): many sessions decode together, and each one's
tokens are the tokens it gets alone.

The scheduler here runs without its thread (``start=False``) so that the test decides at which
step each session joins, which one is cancelled, and what each step ran. Sessions differ in
everything a batch must keep apart: document length, policy (full, SnapKV with a small budget,
re-selection, StreamingLLM, SnapKV + H2O decode-time eviction), sampling (greedy, seeded top-p /
top-k), stop strings, token limits; tiny-llama and tiny-gemma3 (sliding-window layers beside
full ones), and one Gemma 3 270M case."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from kvsnap.engine import SamplingParams
from kvsnap.engine.scheduler import Job, Scheduler
from kvsnap.policies import make_policy

from ..conftest import random_tokens

GREEDY = SamplingParams(max_new_tokens=24)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=11)
POLICIES = {
    "full": (lambda: make_policy("full"), "per_turn"),
    "snapkv": (lambda: make_policy("snapkv", budget=12, window=6, kernel=3), "per_turn"),
    "reselect": (lambda: make_policy("snapkv", budget=12, window=6, kernel=3), "reselect"),
    "streaming": (lambda: make_policy("streaming", window=10, sinks=4), "per_turn"),
    "snapkv+h2o": (
        lambda: make_policy(
            "snapkv", budget=12, window=6, kernel=3, decode={"policy": "h2o", "budget": 8, "window": 4}
        ),
        "per_turn",
    ),
}


@dataclass
class Plan:
    policy: str
    doc_len: int
    sampling: SamplingParams
    join: int  # the scheduler step at which the first turn joins the batch
    cancel_after: int = 0  # > 0: the client goes away after this many tokens


PLANS = [
    Plan("full", 40, GREEDY, 0),
    Plan("snapkv", 70, SEEDED, 0),
    Plan("reselect", 55, GREEDY, 2),
    Plan("streaming", 90, SEEDED, 3),
    Plan("snapkv+h2o", 64, GREEDY, 5),
    Plan("snapkv", 33, GREEDY, 7, cancel_after=4),
    Plan("full", 120, SEEDED, 9),  # a long prompt joining while the others decode: 8 chunks
]
FOLLOW_UP = [random_tokens(7, seed=500 + i) for i in range(len(PLANS))]


def new_session(engine, plan: Plan, i: int):
    make, recompress = POLICIES[plan.policy]
    return engine.new_session(make(), recompress, session_id=f"s{i}")


def drive(scheduler: Scheduler, submissions: dict[int, list[tuple[int, Job]]], cancel: dict[int, int]) -> dict:
    """Run steps until every job ended; submit each job at its step; cancel after N tokens."""
    seen: dict[int, int] = {}
    jobs = {i: job for pending in submissions.values() for i, job in pending}
    step = 0
    while step <= max(submissions) or any(not job.ended.is_set() for job in jobs.values()):
        for _, job in submissions.get(step, []):
            scheduler.submit(job)
        scheduler.run_step()
        for i, job in jobs.items():
            seen[i] = job._events.qsize()
            if i in cancel and seen[i] >= cancel[i] and not job.cancelled.is_set():
                job.cancel()
        step += 1
        assert step < 500, "the batch never finished"
    return {i: list(job) for i, job in jobs.items()}


def run_alone(engine, plan: Plan, i: int, doc: list[int], first_tokens: int | None) -> tuple[list[list[int]], object]:
    session = new_session(engine, plan, i)
    sampling = plan.sampling
    if first_tokens is not None:  # the batch's session was cut after this many tokens
        sampling = SamplingParams(**{**_fields(sampling), "max_new_tokens": max(first_tokens, 1)})
    first = engine.turn(session, doc, sampling).tokens
    second = engine.turn(session, FOLLOW_UP[i], plan.sampling).tokens
    return [first, second], session


def _fields(sampling: SamplingParams) -> dict:
    return {f: getattr(sampling, f) for f in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")}


def assert_same_cache(a, b, tol: float = 1e-5) -> None:
    """Same rows kept, same values up to float rounding (a batched matmul sums in another order)."""
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        assert la.keys.shape == lb.keys.shape
        torch.testing.assert_close(la.keys, lb.keys, rtol=tol, atol=tol)
        torch.testing.assert_close(la.values, lb.values, rtol=tol, atol=tol)


@pytest.mark.parametrize("screen", [False, True, "bf16"], ids=["fp32-head", "greedy-screen", "bf16-model"])
def test_every_session_in_a_batch_gets_the_tokens_it_gets_alone(tiny_engine, screen, monkeypatch):
    """With the greedy screen (engine/models/head.py) forced on, a step with 2 or more greedy rows (6 in
    service) takes the bf16 first pass while the same session alone takes the fp32 one: the
    tokens are equal. A bfloat16 model (weights, activations and KV) keeps the invariant: its
    head is its own bf16 first pass, batched or alone."""
    from kvsnap.engine import Engine, load_model

    monkeypatch.setattr("kvsnap.engine.models.head.SCREEN_MIN_ROWS", 2)

    if screen == "bf16":
        engine = Engine(load_model(tiny_engine.loaded.name, dtype="bfloat16"), prefill_chunk=16, greedy_screen=True)
        assert engine.model.dtype == torch.bfloat16
    else:
        engine = tiny_engine if not screen else Engine(tiny_engine.loaded, prefill_chunk=16, greedy_screen=True)
    assert engine.head.screen == bool(screen)
    passes = first_passes(engine, monkeypatch)
    scheduler = Scheduler(engine, threading.RLock(), max_batch=16, step_tokens=4 * engine.prefill_chunk, start=False)
    docs = [random_tokens(p.doc_len, seed=300 + i) for i, p in enumerate(PLANS)]
    sessions = [new_session(engine, p, i) for i, p in enumerate(PLANS)]

    submissions: dict[int, list] = {}
    first_jobs = {}
    for i, (plan, session) in enumerate(zip(PLANS, sessions, strict=True)):
        job = scheduler.job(engine.start(session, docs[i], plan.sampling))
        first_jobs[i] = job
        submissions.setdefault(plan.join, []).append((i, job))
    cancel = {i: p.cancel_after for i, p in enumerate(PLANS) if p.cancel_after}
    first = drive(scheduler, submissions, cancel)
    assert scheduler.stats["batch_le_8"] > 0, "no step ever decoded more than 4 sessions together"

    # every session's follow-up, all joining at once
    second = drive(
        scheduler,
        {0: [(i, scheduler.job(engine.start(s, FOLLOW_UP[i], PLANS[i].sampling))) for i, s in enumerate(sessions)]},
        {},
    )
    for i, plan in enumerate(PLANS):
        cut = first_jobs[i].turn.report.generated_tokens if plan.cancel_after else None
        if plan.cancel_after:
            assert cut >= plan.cancel_after and cut < plan.sampling.max_new_tokens  # it did stop early
        want, alone = run_alone(engine, plan, i, docs[i], cut)
        assert [first[i], second[i]] == want, f"session {i} ({plan.policy}) differs from its run alone"
        assert sessions[i].logical_len == alone.logical_len and sessions[i].transcript == alone.transcript
        assert [m.to_list() for m in sessions[i].marks] == [m.to_list() for m in alone.marks]
        assert_same_cache(sessions[i], alone, tol=1e-5 if screen != "bf16" else 2e-2)
    if screen == "bf16":
        assert sessions[0].cache.layers[0].keys.dtype == torch.bfloat16  # the KV takes the model's dtype
    want_passes = {"bf16": {torch.bfloat16}, True: {torch.bfloat16, torch.float32}, False: set()}[screen]
    assert passes == want_passes  # fp32 model, batched: bf16; alone: fp32


def first_passes(engine, monkeypatch) -> set:
    """The dtypes of the greedy head's first passes (engine/models/head.py) from now on."""
    seen: set = set()
    if engine.head.screen:
        found = engine.head._candidates
        monkeypatch.setattr(
            engine.head, "_candidates", lambda approx, *a: (seen.add(approx.dtype), found(approx, *a))[1]
        )
    return seen


def test_a_long_prompt_holds_decoding_sessions_up_for_one_chunk_per_step(llama_engine):
    engine = llama_engine  # prefill_chunk 16
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
    decoding = engine.new_session("full")
    job = scheduler.submit(engine.start(decoding, random_tokens(20, seed=1), SamplingParams(max_new_tokens=40)))
    while job._events.qsize() < 2:
        scheduler.run_step()
    long_doc = engine.start(engine.new_session("full"), random_tokens(160, seed=2), SamplingParams(max_new_tokens=2))
    scheduler.submit(long_doc)
    steps = 0
    while long_doc.prefilling:
        before = job._events.qsize()
        tokens_before = scheduler.stats["tokens"]
        scheduler.run_step()
        steps += 1
        assert job._events.qsize() == before + 1  # the running session got its token in every step
        # one chunk, plus the decode rows: the running session and, at the last chunk, the newcomer
        assert scheduler.stats["tokens"] - tokens_before <= engine.prefill_chunk + 2
    assert steps == 160 // engine.prefill_chunk


def test_one_sessions_error_ends_that_session_alone(llama_engine):
    engine = llama_engine
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
    sampling = SamplingParams(max_new_tokens=10)
    sessions = [engine.new_session("full") for _ in range(3)]
    docs = [random_tokens(30 + 5 * i, seed=40 + i) for i in range(3)]
    jobs = [scheduler.submit(engine.start(s, d, sampling)) for s, d in zip(sessions, docs, strict=True)]
    broken = jobs[1].turn.detok
    calls = {"n": 0}

    def add(token, original=broken.add):  # a stop check that blows up on the 4th token
        calls["n"] += 1
        if calls["n"] == 4:
            raise ValueError("bad stop string")
        original(token)

    broken.add = add
    while scheduler.run_step():
        pass
    with pytest.raises(ValueError, match="bad stop string"):
        list(jobs[1])
    for i in (0, 2):
        alone = engine.turn(engine.new_session("full"), docs[i], sampling).tokens
        assert list(jobs[i]) == alone and len(alone) >= 4  # they went on past the broken one's end


def test_rows_only_ever_attend_to_their_own_session(llama_engine, monkeypatch):
    """Isolation inside a batch, checked at the attention itself: each row's keys and values are
    views of its own session's cache (same storage, nothing else), and a neighbour's cache,
    planted secret or not, changes nothing in another row's logits (bit for bit)."""
    import kvsnap.engine.capture as capture

    engine = llama_engine
    seen: list[list[tuple[int, int]]] = []
    real = capture.ragged_attention

    def spy(attend, module, query, keys, values, **kwargs):
        storages = [
            (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()) for k, v in zip(keys, values, strict=True)
        ]
        seen.append(storages)
        return real(attend, module, query, keys, values, **kwargs)

    monkeypatch.setattr(capture, "ragged_attention", spy)

    def pair(secret: list[int]):
        victim, neighbour = engine.new_session("full"), engine.new_session("full")
        engine.prefill(victim, random_tokens(40, seed=9))
        engine.prefill(neighbour, secret)
        for s in (victim, neighbour):
            s.transcript.append(5)  # the next token of each: one decode step together
        return victim, neighbour

    victim, neighbour = pair(random_tokens(50, seed=1))
    seen.clear()
    logits = engine.decode_step([victim, neighbour])
    layers = engine.model.config.num_hidden_layers
    assert len(seen) == layers
    for idx, rows in enumerate(seen):
        for s, (k_ptr, v_ptr) in zip((victim, neighbour), rows, strict=True):
            layer = s.cache.layers[idx]
            assert (k_ptr, v_ptr) == (layer._k.untyped_storage().data_ptr(), layer._v.untyped_storage().data_ptr())
        assert rows[0][0] != rows[1][0]

    other_victim, other_neighbour = pair(random_tokens(50, seed=2) * 2)  # another secret, another length
    other = engine.decode_step([other_victim, other_neighbour])
    assert torch.equal(logits[0], other[0])  # the victim's row does not see its neighbour at all
    assert not torch.allclose(logits[1], other[1])


@pytest.mark.slow
def test_gemma_sessions_in_a_batch_match_their_runs_alone(gemma_fp32_engine, monkeypatch):
    engine = gemma_fp32_engine
    monkeypatch.setattr("kvsnap.engine.models.head.SCREEN_MIN_ROWS", 3)  # 6 in service: fewer sessions here
    scheduler = Scheduler(engine, threading.RLock(), max_batch=8, start=False)
    text = "The lighthouse keeper wrote down the weather every morning. " * 40
    # four greedy rows: their batched steps take the bf16 screen (engine/models/head.py), alone the fp32 pass
    plans = [("full", GREEDY), ("snapkv", SEEDED), ("snapkv+h2o", GREEDY), ("snapkv", GREEDY), ("full", GREEDY)]
    docs = [engine.encode(text[: 600 + 300 * i]) for i in range(len(plans))]
    assert engine.head.screen
    passes = first_passes(engine, monkeypatch)
    sessions, jobs = [], []
    for (policy, sampling), doc in zip(plans, docs, strict=True):
        make, recompress = POLICIES[policy]
        session = engine.new_session(make(), recompress)
        sessions.append(session)
        jobs.append(scheduler.submit(engine.start(session, doc, sampling)))
        scheduler.run_step()  # each joins a step later
    while scheduler.run_step():
        pass
    assert scheduler.stats["batch_le_8"] > 0  # a step decoded five rows
    for (policy, sampling), doc, job, session in zip(plans, docs, jobs, sessions, strict=True):
        make, recompress = POLICIES[policy]
        alone = engine.new_session(make(), recompress)
        assert list(job) == engine.turn(alone, doc, sampling).tokens, policy
        assert_same_cache(session, alone, tol=1e-4)
    assert passes == {torch.bfloat16, torch.float32}


def test_ignore_eos_keeps_generating_to_the_limit(llama_engine, monkeypatch):
    """Fixed-length answers (load tests): an end-of-sequence token does not end the turn."""
    engine = llama_engine
    doc = random_tokens(30, seed=5)
    first = engine.turn(engine.new_session("full"), doc, SamplingParams(max_new_tokens=3)).tokens[0]
    monkeypatch.setattr(engine, "eos_ids", {first})  # the first answer token is now an EOS
    ended = engine.turn(engine.new_session("full"), doc, SamplingParams(max_new_tokens=8))
    assert ended.tokens == [] and ended.finish_reason == "stop"
    fixed = engine.turn(engine.new_session("full"), doc, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(fixed.tokens) == 8 and fixed.tokens[0] == first and fixed.finish_reason == "length"


def test_a_turn_cancelled_while_waiting_leaves_the_queue_at_once(llama_engine):
    """A client that goes away while its turn waits for a place in a full batch is not kept
    waiting for the batch: its turn leaves the queue at the next step, never having run."""
    engine = llama_engine
    scheduler = Scheduler(engine, threading.RLock(), max_batch=1, start=False)
    running = scheduler.submit(engine.start(engine.new_session("full"), random_tokens(20, seed=1), GREEDY))
    session = engine.new_session("full")
    waiting = scheduler.submit(engine.start(session, random_tokens(20, seed=2), GREEDY))
    scheduler.run_step()
    waiting.cancel()
    scheduler.run_step()
    assert waiting.ended.is_set() and list(waiting) == [] and waiting.turn.report is None
    assert session.logical_len == 0 and session.transcript == []  # it never ran
    assert not running.ended.is_set()


def test_a_failed_forward_fails_its_turns_with_a_retryable_error_and_the_batch_goes_on(llama_engine, monkeypatch):
    from kvsnap.errors import Unavailable

    engine = llama_engine
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, step_tokens=64, start=False)
    jobs = [
        scheduler.submit(engine.start(engine.new_session("full"), random_tokens(12, seed=i), GREEDY)) for i in range(2)
    ]
    real = engine.step
    monkeypatch.setattr(engine, "step", lambda rows: (_ for _ in ()).throw(RuntimeError("device lost")))
    scheduler.run_step()  # both prompts in one step, which fails
    for job in jobs:
        assert job.ended.is_set()
        with pytest.raises(Unavailable, match="device lost"):
            list(job)
    monkeypatch.setattr(engine, "step", real)
    doc = random_tokens(20, seed=9)
    later = scheduler.submit(engine.start(engine.new_session("full"), doc, GREEDY))
    while scheduler.run_step():
        pass
    assert list(later) == engine.turn(engine.new_session("full"), doc, GREEDY).tokens


def test_a_stopped_scheduler_never_leaves_a_consumer_waiting(llama_engine):
    engine = llama_engine
    scheduler = Scheduler(engine, threading.RLock(), max_batch=1)  # its own thread
    jobs = [
        scheduler.submit(engine.start(engine.new_session("full"), random_tokens(20, seed=i), GREEDY)) for i in range(3)
    ]
    scheduler.stop()
    for job in jobs:
        assert job.wait(10), "a job was left waiting"
        try:
            list(job)
        except RuntimeError as exc:
            assert "stopped" in str(exc)
    assert not scheduler.alive or scheduler._thread.join(5) is None


def test_the_engines_lm_head_equals_the_models(tiny_engine):
    """Engine._lm_head (W @ h^T, a lone row as two) gives the logits the model's own forward gives."""
    from kvsnap.engine.batch import Row

    engine = tiny_engine
    tokens = random_tokens(35, seed=4)
    a = engine.step([Row(engine.new_session("full"), tokens), Row(engine.new_session("full"), tokens[:9])])
    engine._own_head = False
    try:
        b = engine.step([Row(engine.new_session("full"), tokens), Row(engine.new_session("full"), tokens[:9])])
    finally:
        engine._own_head = True
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[0], engine.reference_logits(tokens), rtol=1e-4, atol=1e-4)
