"""Shared prompt prefixes (engine/prefixes.py): a session that starts from another session's
prefix rows holds the cache, and gives the answers, of one that prefilled everything alone;
one tenant's prefix never serves another's; the budget holds, least recently used leaves first."""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine import Engine, SamplingParams
from kvsnap.engine.cache import export_kv
from kvsnap.engine.cold import export_cold
from kvsnap.engine.prefixes import PrefixCache, root_key, window_queries
from kvsnap.engine.turn import Turn
from kvsnap.policies import make_policy

from ..conftest import random_tokens

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
DOCUMENT = random_tokens(50, seed=41)  # three blocks of 16 and two tokens
QUESTIONS = [random_tokens(n, seed=50 + n) for n in (9, 12, 20)]


def snapkv(rest: str = "drop"):
    return make_policy("snapkv", budget=24, window=8, rest=rest)


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
    cold_a, cold_b = export_cold(a.cache), export_cold(b.cache)  # a mixed-precision session's quantized rows
    assert (cold_a is None) == (cold_b is None)
    if cold_a is not None:
        assert cold_a[1] == cold_b[1]
        ka, kb = ka + cold_a[0], kb + cold_b[0]
    assert len(ka) == len(kb)
    for x, y in zip(ka, kb, strict=True):
        assert x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("rest", ["drop", "kivi4"])  # kivi4: the rows left out quantized (copied in first)
def test_a_session_started_from_a_shared_prefix_is_the_one_that_prefilled_alone(sharing, tiny_engine, rest):
    opened(sharing, DOCUMENT + QUESTIONS[0])  # adds blocks 0-2 of the document (and no more)
    assert sharing.prefixes.stats()["blocks"] == 3
    for q in QUESTIONS[1:]:
        shared, got = opened(sharing, DOCUMENT + q, policy=snapkv(rest))
        alone, want = opened(tiny_engine, DOCUMENT + q, scope=None, policy=snapkv(rest))
        assert (export_cold(shared.cache) is None) == (rest == "drop")
        assert got.report.cached_tokens == 48 and want.report.cached_tokens == 0
        assert got.report.prompt_tokens == want.report.prompt_tokens == len(DOCUMENT + q)
        assert got.tokens == want.tokens
        assert_same_cache(shared, alone)
        follow = random_tokens(7, seed=77)  # the next turn reads only the session's own rows
        assert sharing.turn(shared, follow, GREEDY).tokens == tiny_engine.turn(alone, follow, GREEDY).tokens
        assert_same_cache(shared, alone)


def test_an_observation_window_reaching_into_the_blocks_takes_their_queries(sharing, tiny_engine):
    """A prompt that is the shared prefix and little more: its observation window (SnapKV's
    queries) reaches into the shared blocks. Each block keeps the queries its prefill had in its
    window (a chunk's last ``window`` tokens), so a session whose window starts among those
    starts from every block and prefills only its own tokens, and holds and answers what a
    session that prefilled alone does; a wider window than the blocks hold stops the prefix
    before it. One token at least is computed."""
    opened(sharing, DOCUMENT + QUESTIONS[2])  # blocks 0-3, each keeping its chunk's last 8 queries
    prompt = DOCUMENT[:48] + [7] * 7  # 55 tokens, window 8: from token 47, which block 2 keeps
    shared, got = opened(sharing, prompt)
    alone, want = opened(tiny_engine, prompt, scope=None)
    assert got.report.cached_tokens == 48 and got.tokens == want.tokens
    assert_same_cache(shared, alone)  # compressed by the same queries
    replayed = sharing.new_session(snapkv())  # a rebuild (after a failover) prefills its log from the start
    sharing.rebuild(replayed, list(shared.transcript), shared.logical_len, shared.marks)
    assert_same_cache(replayed, shared)
    wider = make_policy("snapkv", budget=24, window=16)  # from token 39: block 2 keeps 40 on
    shared, got = opened(sharing, prompt, policy=wider)
    alone, want = opened(tiny_engine, prompt, scope=None, policy=make_policy("snapkv", budget=24, window=16))
    assert got.report.cached_tokens == 32 and got.tokens == want.tokens
    assert_same_cache(shared, alone)
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
    # nor by timing: the work is the same as for a text nobody sent (a miss), and the router's tag
    # (the first block's name) is the tenant's own, so another's document steers no placement
    assert root_key("acme", DOCUMENT, 16) != root_key("globex", DOCUMENT, 16)


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
    counted = cache.stats()
    assert cache.known("t", a) == 6 and cache.known("t", [1, 2, 7, 7]) == 2 and cache.known("u", a) == 0
    assert cache.stats() == counted  # a look that is no hit or miss
    with pytest.raises(ValueError):
        cache.add("t", [1, 2, 3], rows(6, 16))


def test_blocks_keep_the_window_queries_their_chunk_had():
    """``add_chain``'s ``queries`` (tokens 3-6's here): each new block keeps those of its own
    tokens, counted in its bytes; a lookup whose window starts at ``window_from`` takes the
    longest prefix that holds every query from there, and ``window_queries`` joins them."""
    cache = PrefixCache(block=2, budget_bytes=1 << 20)
    tokens = random_tokens(8, seed=5)
    queries = torch.arange(4 * 3.0).view(1, 1, 4, 3)  # one head of 3 dims, tokens 3-6
    assert cache.add_chain("t", tokens[:6], [rows(2, 16), rows(4, 16), rows(6, 16)], (3, {0: queries})) == 3
    held = cache.lookup("t", tokens, 8)
    assert [b.queried for b in held] == [0, 1, 2] and held[2].nbytes == 32 + 2 * 3 * 4
    assert len(cache.lookup("t", tokens, 8, window_from=3)) == 3  # tokens 3-5: held
    assert len(cache.lookup("t", tokens, 8, window_from=2)) == 1  # token 2's is not: stop at 2
    assert len(cache.lookup("t", tokens, 8, window_from=6)) == 3  # past the prefix: nothing needed
    joined = window_queries(held, 2, 4)[0]
    assert torch.equal(joined, queries[:, :, 1:3])  # tokens 4 and 5
    assert window_queries(held, 2, 6) == {}


def test_a_block_larger_than_the_budget_is_not_held():
    cache = PrefixCache(block=2, budget_bytes=16)
    assert not cache.add("t", [1, 2], rows(1, 16)) and cache.nbytes == 0 and len(cache) == 0


def test_sessions_on_one_document_hold_one_shared_copy_and_their_own_rows(sharing, directory_factory):
    """KV held for N sessions on one document (measured from the tiers and the prefix cache):
    one copy of the document's blocks, however many sessions, and each session's own
    compressed rows."""
    from kvsnap.actors.worker import Worker
    from kvsnap.store.tiers import build_store

    worker = Worker(sharing, directory_factory(), build_store(10**9, 10**9), "w1")
    shared, own = [], []
    questions = [q[:9] for q in QUESTIONS]  # each prompt 59 tokens: the document's three blocks and its own rest
    for i, question in enumerate(questions):
        opened = worker.open("acme", f"s{i}", DOCUMENT + question, snapkv(), sampling=GREEDY)
        assert opened.report.cached_tokens == (0 if i == 0 else 48)
        shared.append(sharing.prefixes.stats()["bytes"])
        own.append(worker.store.peek(f"acme/s{i}").nbytes)
    per_block = shared[0] // 3  # its rows, and its chunk's last 8 queries (SnapKV's window)
    assert all(b.queried == 8 for b in sharing.prefixes._blocks.values())
    assert shared == [3 * per_block] * len(questions)  # the document's three blocks, held once
    assert sum(worker.store.bytes_by_tier().values()) == sum(own)  # the tiers: the sessions' own rows only
    full = per_block // 16 * (len(DOCUMENT) + 9)  # a block holds 16 rows of every layer
    assert max(own) < full  # each session holds its compressed rows, not the document's full KV
    worker.stop()


def test_the_block_is_a_chunk_in_float32_and_finer_in_bfloat16():
    from kvsnap.engine.prefixes import FINE_BLOCK, block_for

    assert block_for(1024, torch.float32) == 1024  # bit-exact: a chunk
    assert block_for(1024, torch.bfloat16) == FINE_BLOCK == 16  # vLLM's
    assert block_for(100, torch.bfloat16) == 100  # 16 does not divide it: a chunk


@pytest.mark.parametrize("block", [4, 8])
def test_in_bfloat16_a_session_starts_from_fine_blocks_and_answers_as_alone(tiny_engine, block):
    """bf16 (the blocks finer than a chunk): a later session starts from all whole blocks of the
    document that leave its observation window, answers what a session that prefilled alone
    answers, and holds its cache within bf16's rounding."""
    from kvsnap.engine import load_model

    loaded = load_model(tiny_engine.loaded.name, dtype="bfloat16")
    sharing = Engine(loaded, prefill_chunk=16, prefix_cache_bytes=64 << 20, prefix_block=block)
    alone = Engine(loaded, prefill_chunk=16)
    opened(sharing, DOCUMENT + QUESTIONS[0])  # 59 tokens: adds every whole block of them
    assert sharing.prefixes.stats()["blocks"] == (len(DOCUMENT) + 9) // block
    for q in QUESTIONS[1:]:
        shared, got = opened(sharing, DOCUMENT + q)
        own, want = opened(alone, DOCUMENT + q, scope=None)
        assert got.report.cached_tokens == len(DOCUMENT) // block * block  # up to the document's last whole block
        assert got.tokens == want.tokens
        for x, y in zip(export_kv(shared.cache), export_kv(own.cache), strict=True):
            assert x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=2**-6, atol=2**-6)


def test_the_router_names_a_prompt_by_its_first_chunk_whatever_the_block():
    """The ingress knows no block size: it names a prompt by its first ``route_tokens`` tokens,
    and a replica's roots are those names for the openings it holds."""
    cache = PrefixCache(block=2, budget_bytes=1 << 20, route_tokens=4)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert cache.add("t", tokens[:2], rows(1, 16)) and cache.roots() == []  # not yet 4 tokens
    assert cache.add("t", tokens[:4], rows(2, 16)) and cache.add("t", tokens[:6], rows(3, 16))
    assert cache.roots() == [root_key("t", tokens, 4)] and root_key("u", tokens, 4) not in cache.roots()
    with pytest.raises(ValueError):
        PrefixCache(block=3, budget_bytes=1, route_tokens=4)


def test_a_block_that_does_not_divide_the_chunk_is_refused(llama_engine):
    from kvsnap.errors import InvalidArgument
    from kvsnap.service.config import ServiceConfig

    with pytest.raises(ValueError, match="prefix_block"):
        ServiceConfig(prefill_chunk=1024, prefix_block=100)
    assert ServiceConfig(prefill_chunk=1024, prefix_block=64).prefix_block == 64
    with pytest.raises(InvalidArgument, match="prefix_block"):
        Engine(llama_engine.loaded, prefill_chunk=16, prefix_cache_bytes=1 << 20, prefix_block=5)


def test_a_chain_added_block_by_block_is_named_as_if_hashed_from_its_root():
    """``add`` reuses the chain it hashed last where the next prompt opens with the same blocks;
    the names are those a fresh cache makes, for the same tenant only."""
    cache, fresh = PrefixCache(block=2, budget_bytes=1 << 20), PrefixCache(block=2, budget_bytes=1 << 20)
    tokens = random_tokens(12, seed=9)
    for n in range(2, 13, 2):
        assert cache.add("t", tokens[:n], rows(n, 16))
    other = tokens[:5] + [tokens[5] + 1] + tokens[6:]  # the same first two blocks, then not
    for scope, text in (("t", tokens), ("t", other), ("u", tokens)):
        assert list(cache._keys(scope, text, 6)) == list(fresh._keys(scope, text, 6))
    assert cache.known("t", tokens) == 12 and cache.known("t", other) == 4 and cache.known("u", tokens) == 0


def test_a_turns_budget_counts_what_its_prefill_will_take_from_the_shared_rows(sharing):
    """Before it starts, a first turn on a known document asks the step's budget for its own
    tail only, and a KVzap turn (scored as its chunks pass: it prefills every row) for all of it."""
    opened(sharing, DOCUMENT + QUESTIONS[0])  # the document's blocks
    prompt = DOCUMENT + QUESTIONS[1]
    for policy, want in ((snapkv(), len(prompt) - 48), (make_policy("kvzap", budget=24, window=8), 16)):
        session = sharing.new_session(policy)
        session.prefix_scope = "acme"
        turn = Turn(sharing, session, prompt, GREEDY)  # not started: nothing checked, nothing run
        assert turn.next_chunk(sharing.prefill_chunk) == want


def test_a_chunk_adds_its_blocks_as_one_chain():
    """``add_chain`` (a prefill chunk's blocks at once): the blocks ``add`` would make one by one,
    known ones skipped, a chain stopped where its parent is missing, and over the budget the
    chain's deepest blocks go first (its longest prefix that fits stays)."""
    one_by_one, chained = PrefixCache(block=2, budget_bytes=1 << 20), PrefixCache(block=2, budget_bytes=1 << 20)
    tokens = random_tokens(8, seed=3)
    for n in range(2, 9, 2):
        one_by_one.add("t", tokens[:n], rows(n, 16))
    assert chained.add_chain("t", tokens[:4], [rows(2, 16), rows(4, 16)]) == 2
    assert chained.add_chain("t", tokens, [rows(4, 16), rows(6, 16), rows(8, 16)]) == 2  # the first is known
    assert list(chained._blocks) == list(one_by_one._blocks) and chained.nbytes == one_by_one.nbytes
    assert chained.add_chain("t", [9, 9] + tokens[2:], [rows(0, 16), rows(0, 16)]) == 0  # no parent held
    small = PrefixCache(block=2, budget_bytes=2 * 32)
    assert small.add_chain("t", tokens[:6], [rows(2, 16), rows(4, 16), rows(6, 16)]) == 2
    assert small.known("t", tokens) == 4 and small.stats()["evictions"] == 1
    with pytest.raises(ValueError):
        small.add_chain("t", tokens[:2], [rows(1, 16), rows(2, 16)])  # more blocks than the tokens hold
