"""Shared prompt prefixes (engine/prefixes.py): a session that starts from another session's
prefix rows holds the cache, and gives the answers, of one that prefilled everything alone;
one tenant's prefix never serves another's; the budget holds, least recently used leaves first."""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine import Engine, SamplingParams
from kvsnap.engine.cache import export_kv
from kvsnap.engine.prefixes import PrefixCache
from kvsnap.policies import make_policy

from .conftest import random_tokens

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
DOCUMENT = random_tokens(50, seed=41)  # three blocks of 16 and two tokens
QUESTIONS = [random_tokens(n, seed=50 + n) for n in (9, 12, 20)]


def snapkv():
    return make_policy("snapkv", budget=24, window=8)


@pytest.fixture
def sharing(tiny_engine) -> Engine:
    """The tiny engine's model with a prefix cache (blocks of its 16-token chunks)."""
    return Engine(tiny_engine.loaded, prefill_chunk=tiny_engine.prefill_chunk, prefix_cache_bytes=64 << 20)


def opened(engine: Engine, tokens: list[int], scope: str | None = "acme", policy=None):
    session = engine.new_session(policy or snapkv())
    session.prefix_scope = scope
    return session, engine.turn(session, tokens, GREEDY)


def assert_same_cache(a, b) -> None:
    ka, kb = export_kv(a.cache), export_kv(b.cache)
    assert len(ka) == len(kb)
    for x, y in zip(ka, kb, strict=True):
        assert x.shape == y.shape and torch.equal(x, y)


def test_a_session_started_from_a_shared_prefix_is_the_one_that_prefilled_alone(sharing, tiny_engine):
    opened(sharing, DOCUMENT + QUESTIONS[0])  # adds blocks 0-2 of the document (and no more)
    assert sharing.prefixes.stats()["blocks"] == 3
    for q in QUESTIONS[1:]:
        shared, got = opened(sharing, DOCUMENT + q)
        alone, want = opened(tiny_engine, DOCUMENT + q, scope=None)
        assert got.report.cached_tokens == 48 and want.report.cached_tokens == 0
        assert got.report.prompt_tokens == want.report.prompt_tokens == len(DOCUMENT + q)
        assert got.tokens == want.tokens
        assert_same_cache(shared, alone)
        follow = random_tokens(7, seed=77)  # the next turn reads only the session's own rows
        assert sharing.turn(shared, follow, GREEDY).tokens == tiny_engine.turn(alone, follow, GREEDY).tokens
        assert_same_cache(shared, alone)


def test_the_observation_window_is_always_prefilled(sharing):
    """A prompt that is the shared prefix and little more starts from fewer blocks: its last
    ``window`` tokens (SnapKV's queries) and one token at least are computed."""
    opened(sharing, DOCUMENT + QUESTIONS[2])  # blocks 0-3 (the fourth ends inside the question)
    _, got = opened(sharing, DOCUMENT[:48] + [7] * 7)  # 55 tokens, window 8: 47 may come from blocks
    assert got.report.cached_tokens == 32
    _, got = opened(sharing, DOCUMENT[:32], policy=make_policy("full"))
    assert got.report.cached_tokens == 16  # no window, but one token to compute the next token from


def test_a_rebuild_of_a_session_that_started_from_a_prefix_replays_it_exactly(sharing):
    opened(sharing, DOCUMENT + QUESTIONS[0])
    shared, got = opened(sharing, DOCUMENT + QUESTIONS[1])
    assert got.report.cached_tokens == 48
    replayed = sharing.new_session(snapkv())
    sharing.rebuild(replayed, list(shared.transcript), shared.logical_len, shared.marks)
    assert_same_cache(replayed, shared)


def test_one_tenants_prefix_never_serves_another(sharing):
    opened(sharing, DOCUMENT + QUESTIONS[0], scope="acme")
    misses = sharing.prefixes.stats()["misses"]
    _, got = opened(sharing, DOCUMENT + QUESTIONS[1], scope="globex")
    assert got.report.cached_tokens == 0  # the same text, another tenant: computed again
    assert sharing.prefixes.stats()["misses"] == misses + 1
    _, got = opened(sharing, DOCUMENT + QUESTIONS[1], scope=None)  # a session that shares nothing
    assert got.report.cached_tokens == 0
    held = sharing.prefixes.stats()["bytes_by_tenant"]
    assert set(held) == {"acme", "globex"} and held["acme"] == held["globex"]


def test_each_block_holds_the_rows_its_layers_keep(sharing):
    session, _ = opened(sharing, DOCUMENT[:32] + [5] * 9, policy=make_policy("full"))
    stats = sharing.prefixes.stats()
    layers = session.cache.layers
    per_row = sum(2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size() for layer in layers)
    assert stats["blocks"] == 2 and stats["bytes"] == 2 * 16 * per_row  # sliding layers: every row of a block


def rows(value: float, nbytes_per_row: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.full((1, 1, 2, nbytes_per_row // 8), value, dtype=torch.float32)  # 2-token blocks
    return [(t.clone(), t.clone())]


def test_the_budget_evicts_least_recently_used_leaves_first():
    cache = PrefixCache(block=2, budget_bytes=4 * 32)  # four blocks of 32 bytes
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9]
    assert cache.add("t", a[:2], rows(1, 16)) and cache.add("t", a[:4], rows(2, 16)) and cache.add("t", a, rows(3, 16))
    assert not cache.add("t", a[:4], rows(2, 16))  # known already
    assert not cache.add("t", [7, 7, 8, 8], rows(0, 16))  # its parent is not there
    assert cache.add("t", b, rows(4, 16))  # shares the first block with a
    assert len(cache) == 4 and cache.nbytes == 4 * 32
    assert len(cache.lookup("t", a, limit=6)) == 3  # a's path is now the most recent
    assert cache.add("t", [5, 5], rows(5, 16))  # over budget: the oldest leaf goes, b's second block
    assert len(cache.lookup("t", b, limit=4)) == 1
    assert len(cache.lookup("t", a, limit=6)) == 3 and cache.nbytes == 4 * 32
    assert cache.stats()["evictions"] == 1
    assert len(cache.lookup("t", a, limit=5)) == 2  # only whole blocks within the limit
    assert cache.lookup("u", a, limit=6) == []  # another scope
    with pytest.raises(ValueError):
        cache.add("t", [1, 2, 3], rows(6, 16))


def test_a_block_larger_than_the_budget_is_not_held():
    cache = PrefixCache(block=2, budget_bytes=16)
    assert not cache.add("t", [1, 2], rows(1, 16)) and cache.nbytes == 0 and len(cache) == 0
