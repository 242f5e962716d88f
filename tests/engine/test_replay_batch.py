"""A rebuild rides in the batch (engine/replay.py): a lost session's logged turns replay a chunk a
step beside the running turns, which keep decoding meanwhile, and the cache it leaves is the
lost one, as a replay alone leaves it. Tiny random-weight models (prefill chunk 16)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvsnap.engine import SamplingParams
from kvsnap.engine.scheduler import Scheduler
from kvsnap.errors import InvalidArgument
from kvsnap.policies import make_policy

from ..conftest import random_tokens

SAMPLING = SamplingParams(max_new_tokens=5)
H2O = {"policy": "h2o", "budget": 12, "window": 4}
POLICIES = {  # small budgets so that every turn drops rows
    "snapkv": (lambda: make_policy("snapkv", budget=24, window=8, kernel=3), "per_turn"),
    "reselect": (lambda: make_policy("snapkv", budget=24, window=8, kernel=3), "reselect"),
    "snapkv+h2o": (lambda: make_policy("snapkv", budget=24, window=8, kernel=3, decode=H2O), "per_turn"),
    "snapkv/q4": (lambda: make_policy("snapkv", budget=24, window=8, kernel=3, rest="kivi4"), "per_turn"),
}


def lost_session(engine, spec: str):
    """A session of three turns (a 70-token document, then two questions), as a replica held it."""
    make, recompress = POLICIES[spec]
    session = engine.new_session(make(), recompress)
    engine.turn(session, random_tokens(70, seed=3), SAMPLING)
    for i in range(2):
        engine.turn(session, random_tokens(9, seed=30 + i), SAMPLING)
    return session


def assert_same_cache(got, want, tol: float = 0.0) -> None:
    """The same log, the same rows kept, the same values: bit for bit (``tol`` 0), or up to float
    rounding where rows shared a step with others (a batched product sums in another order)."""
    assert got.logical_len == want.logical_len and got.transcript == want.transcript and got.marks == want.marks
    pairs = [(a.keys, b.keys) for a, b in zip(got.cache.layers, want.cache.layers, strict=True)]
    pairs += [(a.values, b.values) for a, b in zip(got.cache.layers, want.cache.layers, strict=True)]
    for a, b in zip(got.cache.layers, want.cache.layers, strict=True):  # a mixed-precision session's quantized rows
        assert (getattr(a, "cold", None) is None) == (getattr(b, "cold", None) is None)
        if getattr(b, "cold", None) is not None:
            pairs += list(zip(a.cold.dequantized(), b.cold.dequantized(), strict=True))
    if want.full_kv is not None:  # a reselect session's full copy, row for row
        assert got.full_kv.keys() == want.full_kv.keys() and got.full_len == want.full_len
        pairs += [(got.full_kv[idx][i], kv[i]) for idx, kv in want.full_kv.items() for i in (0, 1)]
    for a, b in pairs:
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", sorted(POLICIES))
def test_a_replay_in_the_batch_leaves_the_lost_cache_while_others_decode(tiny_engine, spec):
    engine = tiny_engine
    lost = lost_session(engine, spec)
    make, recompress = POLICIES[spec]
    alone = engine.new_session(make(), recompress)
    engine.rebuild(alone, list(lost.transcript), lost.logical_len, list(lost.marks))
    assert_same_cache(alone, lost)

    # a running turn, decoding, then the replay joins the batch
    prompt, long_answer = random_tokens(20, seed=5), SamplingParams(max_new_tokens=60)
    want_tokens = engine.turn(engine.new_session("full"), prompt, long_answer).tokens
    scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
    running = scheduler.submit(engine.start(engine.new_session("full"), prompt, long_answer))
    while running._events.qsize() < 2:
        scheduler.run_step()
    replayed = engine.new_session(make(), recompress)
    replay = scheduler.submit(engine.replaying(replayed, list(lost.transcript), lost.logical_len, list(lost.marks)))
    steps = 0
    while not replay.ended.is_set():
        before = running._events.qsize()
        scheduler.run_step()
        steps += 1
        assert running._events.qsize() == before + 1  # the running turn got its token in every step
    assert steps > 70 // engine.prefill_chunk  # the replay took a step per chunk, not one step
    assert replay.error is None and list(replay) == []  # no tokens: a replay hands nothing out
    assert_same_cache(replayed, lost, tol=1e-5)
    while scheduler.run_step():
        pass
    assert list(running) == want_tokens  # the running turn's tokens are its tokens alone
    assert scheduler.stats["replays"] == 1 and scheduler.stats["turns"] == 1


def test_a_replay_needs_an_empty_session_and_falls_back_without_marks(llama_engine):
    lost = lost_session(llama_engine, "snapkv")
    with pytest.raises(InvalidArgument, match="empty session"):
        llama_engine.replaying(lost, list(lost.transcript), lost.logical_len, list(lost.marks))
    session = llama_engine.new_session(POLICIES["snapkv"][0](), "per_turn")
    assert llama_engine.replaying(session, list(lost.transcript), lost.logical_len, None) is None  # one pass instead
    assert llama_engine.replaying(session, list(lost.transcript), lost.logical_len, list(lost.marks[:1])) is None
