"""A turn's first token goes out before its prompt's compression (engine/turn.py, ``settle``):
the first token comes from the prompt's last logits, which no compression changes, so the
compression runs once that token is handed out, before the session's first decode step, and
no later. Alone and in the batch; a turn that ends at its first token is compressed as it
ends; a compression that fails ends its own turn alone."""

from __future__ import annotations

import threading
import time

import pytest

from kvsnap.engine import SamplingParams
from kvsnap.engine.cache import full_layer_indices
from kvsnap.engine.scheduler import Scheduler
from kvsnap.policies import make_policy

from ..conftest import random_tokens


def snapkv():
    return make_policy("snapkv", budget=12, window=6, kernel=3)


def compressed(engine, doc) -> int:
    """The rows a full-attention layer keeps of ``doc`` once compressed (a turn of one token)."""
    session = engine.new_session(snapkv())
    engine.turn(session, doc, SamplingParams(max_new_tokens=1))
    (n,) = kept(session)
    assert n < len(doc)
    return n


def kept(session) -> set[int]:
    return {session.cache.layers[i].kept_len for i in full_layer_indices(session.cache)}


def test_the_first_token_goes_out_before_the_compression_and_the_next_step_runs_on_it(llama_engine):
    engine = llama_engine
    doc = random_tokens(70, seed=3)
    sampling = SamplingParams(max_new_tokens=8)
    alone = engine.turn(engine.new_session(snapkv()), doc, sampling)
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
    session = engine.new_session(snapkv())
    job = scheduler.submit(engine.start(session, doc, sampling))
    while not job._events.qsize():  # the prompt's chunks, up to its first token
        assert scheduler.run_step()
    assert kept(session) == {len(doc)}  # handed out on the uncompressed cache
    assert job.turn.timer.compress_s == 0
    scheduler.run_step()  # the second token: its decode step runs on the compressed cache
    assert kept(session) == {compressed(engine, doc) + 1}
    assert job.turn.timer.compress_s > 0
    while scheduler.run_step():
        pass
    assert list(job) == alone.tokens
    assert job.turn.report.kept_len == alone.report.kept_len


@pytest.mark.parametrize("batched", [False, True])
def test_a_turn_that_ends_at_its_first_token_is_compressed_as_it_ends(llama_engine, batched):
    engine = llama_engine
    session, doc = engine.new_session(snapkv()), random_tokens(50, seed=4)
    turn = engine.start(session, doc, SamplingParams(max_new_tokens=1))
    if batched:
        scheduler = Scheduler(engine, threading.RLock(), start=False)
        job = scheduler.submit(turn)
        while scheduler.run_step():
            pass
        assert len(list(job)) == 1
        report = turn.report
    else:
        stream = engine.stream(session, doc, SamplingParams(max_new_tokens=1))
        assert len(list(stream)) == 1
        report = stream.report
    n = 12 + 6  # the budget and the observation window
    assert kept(session) == {n} and report.kept_len == n and report.compress_s > 0


def test_a_compression_that_fails_after_the_first_token_ends_that_turn_alone(llama_engine, monkeypatch):
    engine = llama_engine
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
    sampling = SamplingParams(max_new_tokens=6)
    docs = [random_tokens(40, seed=10), random_tokens(45, seed=11)]
    broken, fine = (engine.new_session(snapkv()) for _ in docs)
    jobs = [scheduler.submit(engine.start(s, d, sampling)) for s, d in zip((broken, fine), docs, strict=True)]
    original = type(engine).after_prefill

    def after_prefill(self, job):
        if job.session is broken:
            raise RuntimeError("scoring blew up")
        original(self, job)

    monkeypatch.setattr(type(engine), "after_prefill", after_prefill)
    while scheduler.run_step():
        pass
    with pytest.raises(RuntimeError, match="scoring blew up"):
        list(jobs[0])
    monkeypatch.undo()
    assert list(jobs[1]) == engine.turn(engine.new_session(snapkv()), docs[1], sampling).tokens


def test_a_prompt_that_arrives_meanwhile_gets_its_first_token_before_an_earlier_ones_compression(llama_engine):
    """The compression (and second token) of a turn whose prompt just ended waits one step when
    the next step has another turn's prompt, and never more than one."""
    engine = llama_engine
    sampling = SamplingParams(max_new_tokens=6)
    docs = [random_tokens(14, seed=20), random_tokens(15, seed=21), random_tokens(13, seed=22)]  # one chunk each
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
    sessions = [engine.new_session(snapkv()) for _ in docs]
    first = scheduler.submit(engine.start(sessions[0], docs[0], sampling))
    scheduler.run_step()  # the first prompt: its first token is out
    assert first._events.qsize() == 1 and first.turn.unsettled
    second = scheduler.submit(engine.start(sessions[1], docs[1], sampling))
    scheduler.run_step()  # the second prompt, alone: the first turn waits, uncompressed
    assert second._events.qsize() == 1 and first._events.qsize() == 1 and first.turn.unsettled
    third = scheduler.submit(engine.start(sessions[2], docs[2], sampling))
    scheduler.run_step()  # the third prompt; the first turn waited once: now it goes on
    assert not first.turn.unsettled and first._events.qsize() == 2
    assert second.turn.unsettled and third.turn.unsettled  # each waits its one step
    while scheduler.run_step():
        pass
    for job, session, doc in zip((first, second, third), sessions, docs, strict=True):
        alone = engine.turn(engine.new_session(snapkv()), doc, sampling)
        assert list(job) == alone.tokens and kept(session) == {alone.report.kept_len}


def test_the_reports_phases_do_not_count_the_compression_twice(llama_engine, monkeypatch):
    """The compression runs after the first token, inside what was the decode phase: the report
    gives it to ``compress_s`` alone, so prefill, compression and decode add up to no more than
    the turn's wall time (a slow compression would otherwise be counted in both)."""
    engine = llama_engine
    original = type(engine)._compress

    def slow(self, *args):
        time.sleep(0.3)
        return original(self, *args)

    monkeypatch.setattr(type(engine), "_compress", slow)
    began = time.perf_counter()
    session, doc = engine.new_session(snapkv()), random_tokens(40, seed=30)
    report = engine.turn(session, doc, SamplingParams(max_new_tokens=4)).report
    wall = time.perf_counter() - began
    assert report.compress_s >= 0.3
    assert report.prefill_s + report.compress_s + report.decode_s <= wall
