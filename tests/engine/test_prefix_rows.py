"""A session's full layers refer to a shared prefix's rows instead of copying them
(engine/prefix_rows.py, copy-on-write): the chunk kernel reads rows from the blocks exactly as
from one buffer; a later chat that refers gives the tokens and cache a copying one gives, bit
for bit; its prompt's step and its SnapKV compression copy no shared row in whole (the
compression gathers the rows it keeps), any other use of a layer copies them in; the rows stay
readable when the prefix cache evicts the blocks; and its bytes are its own rows."""

from __future__ import annotations

import gc

import pytest
import torch

from kvsnap.cpu_kernels import block_copy, chunk_attention, snapkv_votes
from kvsnap.engine import Engine, SamplingParams, load_model, prefix_rows
from kvsnap.engine.cache import CompressedLayer, SlidingLayer, cache_bytes, export_kv
from kvsnap.engine.prefix_rows import SharedRows, fill_prefix
from kvsnap.engine.prefixes import PrefixCache
from kvsnap.policies import gather_rows

from ..conftest import random_tokens
from ..cpu_kernels.test_block_copy import DOCUMENT, later_chat
from ..cpu_kernels.test_chunk_attention import rows

pytestmark = pytest.mark.skipif(
    not chunk_attention.available() or not block_copy.available(),
    reason="no AMX or AVX-512 BF16 (or KVSNAP_C_KERNELS=0): shared rows are always copied",
)


def as_blocks(keys: torch.Tensor, values: torch.Tensor, shared: int, block: int):
    """The first ``shared`` rows of ``[1, H_kv, L, D]`` keys / values as blocks of ``block`` rows
    (each block's keys and values one allocation, as a prefix cache keeps them), and the rest."""
    parts = [
        torch.stack([keys[:, :, a : a + block], values[:, :, a : a + block]]).clone() for a in range(0, shared, block)
    ]
    pairs = torch.tensor([[p[0].data_ptr(), p[1].data_ptr()] for p in parts], dtype=torch.int64)
    refs = SharedRows(parts, block, pairs)  # ``parts`` as its blocks: kept alive, never read as Blocks
    return refs, keys[:, :, shared:].clone(), values[:, :, shared:].clone()


@pytest.mark.parametrize("variant", chunk_attention.variants())
@pytest.mark.parametrize(
    "heads, kv_heads, dim, count, length, shared, block",
    [(9, 3, 64, 30, 700, 656, 16), (9, 3, 64, 37, 80, 32, 4), (4, 1, 256, 33, 300, 256, 16), (9, 3, 64, 2, 18, 16, 16)],
)
def test_rows_read_from_blocks_give_the_bits_of_one_buffer(variant, heads, kv_heads, dim, count, length, shared, block):
    query, keys, values = rows(heads, kv_heads, dim, count, length, seed=length)
    whole = chunk_attention.attention(query, keys, values, dim**-0.5, None, variant=variant)
    refs, own_k, own_v = as_blocks(keys, values, shared, block)
    paged = chunk_attention.attention(query, own_k, own_v, dim**-0.5, None, variant=variant, shared=refs)
    assert torch.equal(paged, whole)
    copied_k, copied_v = (
        torch.empty(1, kv_heads, shared + 3, dim, dtype=torch.bfloat16),
        torch.empty(1, kv_heads, shared + 3, dim, dtype=torch.bfloat16),
    )
    refs.copy_into(copied_k, copied_v)
    assert torch.equal(copied_k[:, :, :shared], keys[:, :, :shared]) and torch.equal(
        copied_v[:, :, :shared], values[:, :, :shared]
    )
    # SnapKV's votes of the last 8 queries (with those rows' own keys) and a compression's kept rows
    window = query[:, :, -8:]
    assert torch.equal(
        snapkv_votes.votes(window, own_k, dim**-0.5, shared=refs), snapkv_votes.votes(window, keys, dim**-0.5)
    )
    gen = torch.Generator().manual_seed(length)
    positions = torch.stack(
        [torch.randperm(length, generator=gen)[: length // 2].sort().values for _ in range(kv_heads)]
    )[None]
    for got, whole_rows in zip(refs.gather(own_k, own_v, positions), (keys, values), strict=True):
        assert torch.equal(got, gather_rows(whole_rows, positions))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3", "gemma3-270m"])
def sharing(request) -> Engine:
    """bf16 engines sharing prefixes in blocks of 4: the tiny models' heads of 16 dims are not the
    chunk kernel's (a referred layer is copied in before its chunk's attention), the embedded
    Gemma 3's of 256 are (the kernel reads the blocks); both have sliding layers (copied)."""
    loaded = load_model(request.param, dtype="bfloat16")
    return Engine(loaded, prefill_chunk=16, prefix_cache_bytes=64 << 20, prefix_block=4)


def test_a_later_chat_that_refers_answers_and_holds_what_a_copying_one_does(sharing, monkeypatch):
    engine = sharing
    later_chat(engine, random_tokens(5, seed=4))  # the document's blocks
    question = random_tokens(9, seed=5)
    later_chat(engine, question)  # its own blocks too, with its window's queries
    calls, real = [], chunk_attention.attention
    monkeypatch.setattr(
        chunk_attention, "attention", lambda *a, **kw: (calls.append(kw.get("shared")), real(*a, **kw))[1]
    )
    copies, copy_into = [], SharedRows.copy_into
    monkeypatch.setattr(
        SharedRows, "copy_into", lambda self, k, v: (copies.append(self.rows), copy_into(self, k, v))[1]
    )
    referred, by_ref = later_chat(engine, question)
    assert all(layer.shared is None for layer in referred.cache.layers)  # its compression let the blocks go
    full = len(engine.full_layers)
    kernel_heads = engine.model.config.head_dim % 32 == 0
    assert by_ref.report.cached_tokens == 56
    # where the kernels take its heads, the prompt's chunk and SnapKV's votes read the blocks and
    # the compression gathered the rows it keeps from them: the shared rows were never copied in
    # whole; elsewhere they were copied in for the chunk's attention, once a layer
    assert [c.rows for c in calls if c is not None] == ([56] * full if kernel_heads else [])
    assert copies == ([] if kernel_heads else [56] * full)
    copied_in = len(copies)
    monkeypatch.setattr(prefix_rows, "REFER", False)
    copied, by_copy = later_chat(engine, question)
    assert by_copy.report.cached_tokens == 56 and len(copies) == copied_in  # no reference: nothing copied in
    assert by_ref.tokens == by_copy.tokens
    for a, b in zip(export_kv(referred.cache), export_kv(copied.cache), strict=True):
        assert torch.equal(a, b)


def test_a_turn_that_drops_no_row_ends_holding_its_rows(sharing):
    """No compression dropped a row and no decode step ran (full KV, one token): the turn's end
    copies the shared rows in, so the session's bytes, its report and its export are its own."""
    engine = sharing
    later_chat(engine, random_tokens(5, seed=7))
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    results = {}
    for refer in (True, False):
        prefix_rows.REFER = refer
        try:
            session = engine.new_session("full")
            session.prefix_scope = "acme"
            question = random_tokens(6, seed=8 + refer)  # each its own: neither starts from the other's blocks
            results[refer] = session, engine.turn(session, DOCUMENT + question, one)
        finally:
            prefix_rows.REFER = True
    (referred, by_ref), (_, by_copy) = results[True], results[False]
    assert by_ref.report.cached_tokens == by_copy.report.cached_tokens == 48
    assert all(layer.shared is None for layer in referred.cache.layers)
    assert by_ref.report.kv_bytes == by_copy.report.kv_bytes == referred.kv_bytes == by_ref.report.full_kv_bytes


def test_referred_rows_outlive_their_eviction_and_count_as_the_prefix_caches(sharing):
    engine = sharing
    later_chat(engine, random_tokens(5, seed=6))
    blocks = engine.prefixes.lookup("acme", DOCUMENT, len(DOCUMENT))
    referred, copied = engine.new_session("full").cache, engine.new_session("full").cache
    fill_prefix(referred, blocks, 8)
    prefix_rows.REFER = False
    try:
        fill_prefix(copied, blocks, 8)
    finally:
        prefix_rows.REFER = True
    full = [i for i, layer in enumerate(referred.layers) if isinstance(layer, CompressedLayer)]
    assert all(referred.layers[i].shared is not None and referred.layers[i].kept_len == 48 for i in full)
    ids = [id(b) for b in blocks]
    assert all([id(b) for b in referred.layers[i].shared.blocks] == ids for i in full)  # the blocks themselves
    windows = sum(layer.held_bytes() for layer in referred.layers if isinstance(layer, SlidingLayer))
    assert cache_bytes(referred) == windows < cache_bytes(copied)  # the shared rows are not this session's
    sizes = [b.data.numel() for b in blocks]
    engine.prefixes = PrefixCache(engine.prefixes.block, engine.prefixes.budget)  # every block dropped
    del blocks
    gc.collect()
    junk = [torch.full((n,), 7.0, dtype=torch.bfloat16) for n in sizes * 2]  # what freed blocks' memory would take
    for a, b in zip(export_kv(referred), export_kv(copied), strict=True):
        assert torch.equal(a, b)
    assert cache_bytes(referred) == cache_bytes(copied) and len(junk) == 2 * len(sizes)
