"""Shared prefix blocks copied in C (cpu_kernels/block_copy.py). A session starting from them
(engine/prefix_rows.py ``fill_prefix``): the C copy of bf16 blocks into buffers with spare rows gives
the cache one concatenation per layer gives, bit for bit (a sliding layer's window too),
appends go in place after it, and a later chat's answer on a shared document is the same
either way. A first chat making them (``blocks_written``): one allocation a block, rows equal
to torch's copies."""

from __future__ import annotations

from array import array

import pytest
import torch

from kvsnap.cpu_kernels import block_copy
from kvsnap.engine import Engine, SamplingParams, load_model, prefix_rows
from kvsnap.engine.cache import BlockRows, CompressedLayer, export_kv
from kvsnap.engine.prefix_rows import blocks_written, fill_prefix
from kvsnap.engine.prefixes import Block
from kvsnap.policies import make_policy

from ..conftest import random_tokens

pytestmark = pytest.mark.skipif(not block_copy.available(), reason="KVSNAP_C_KERNELS=0: only the concatenation runs")

DOCUMENT = random_tokens(50, seed=61)  # 12 blocks of 4 (longer than tiny-gemma3's window of 16)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3"])
def bf16_sharing(request) -> Engine:
    loaded = load_model(request.param, dtype="bfloat16")
    return Engine(loaded, prefill_chunk=16, prefix_cache_bytes=64 << 20, prefix_block=4)


def later_chat(engine: Engine, question: list[int]):
    session = engine.new_session(make_policy("snapkv", budget=24, window=8))
    session.prefix_scope = "acme"
    return session, engine.turn(session, DOCUMENT + question, GREEDY)


def test_the_c_copy_equals_the_concatenation_and_appends_go_in_place(bf16_sharing, monkeypatch):
    engine = bf16_sharing
    monkeypatch.setattr(prefix_rows, "REFER", False)  # copied: tests/engine/test_prefix_rows.py has referred rows
    later_chat(engine, random_tokens(5, seed=1))  # the document's blocks
    blocks = engine.prefixes.lookup("acme", DOCUMENT, len(DOCUMENT))
    assert len(blocks) == 12
    by_c, by_cat = engine.new_session("full").cache, engine.new_session("full").cache
    fill_prefix(by_c, blocks, 20)
    with monkeypatch.context() as patch:
        patch.setattr(block_copy, "available", lambda: False)  # the concatenation
        fill_prefix(by_cat, blocks)
    for ka, kb in zip(export_kv(by_c), export_kv(by_cat), strict=True):
        assert ka.shape == kb.shape and torch.equal(ka, kb)
    for a, b in zip(by_c.layers, by_cat.layers, strict=True):
        assert isinstance(a, BlockRows) and a._k.shape[-2] == a._end + 20  # the spare rows, after the rows in use
        length = "logical_len" if isinstance(a, CompressedLayer) else "cumulative_length"
        assert getattr(a, length) == getattr(b, length) == 48
        buffer = a._k
        new = torch.randn(1, a.keys.shape[1], 3, a.keys.shape[-1]).bfloat16()
        ka, _ = a.update(new, new)
        kb, _ = b.update(new, new)
        assert torch.equal(ka, kb) and a._k is buffer  # written in place, no new buffer


def test_a_later_chat_answers_the_same_with_either_copy(bf16_sharing, monkeypatch):
    engine = bf16_sharing
    later_chat(engine, random_tokens(5, seed=2))
    question = random_tokens(9, seed=3)
    later_chat(engine, question)  # its own blocks too (to 56), with its window's queries (from 51)
    session_c, by_c = later_chat(engine, question)
    monkeypatch.setattr(block_copy, "available", lambda: False)  # torch's copies both ways
    session_cat, by_cat = later_chat(engine, question)
    assert by_c.report.cached_tokens == by_cat.report.cached_tokens == 56  # all but its last 3 tokens
    assert by_c.tokens == by_cat.tokens
    for ka, kb in zip(export_kv(session_c.cache), export_kv(session_cat.cache), strict=True):
        assert torch.equal(ka, kb)


def test_rows_off_the_host_are_concatenated_never_copied_in_c(monkeypatch):
    """The C copy reads and writes host memory: a GPU's (here: meta) blocks take the concatenation."""

    def never(*args):
        raise AssertionError("the C copy ran on rows off the host")

    monkeypatch.setattr(block_copy, "gather_blocks", never)
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=16)
    heads, dim = engine.model.config.num_key_value_heads, engine.model.config.head_dim
    layers = engine.model.config.num_hidden_layers
    row = torch.empty(1, heads, 4, dim, dtype=torch.bfloat16, device="meta")
    blocks = [Block(bytes([i]), None, "acme", [(row, row) for _ in range(layers)]) for i in range(3)]
    cache_ = engine.new_session("full").cache
    fill_prefix(cache_, blocks, 8)
    assert all(layer.keys.device.type == "meta" and layer.keys.shape[-2] == 12 for layer in cache_.layers)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_blocks_written_in_c_equal_torch_copies_one_allocation_a_block(model, monkeypatch):
    """The whole blocks opening the last ``n`` rows (a chunk ending mid-block too), each block's
    parts in one allocation of its own (a block evicted alone frees its memory)."""
    engine = Engine(load_model(model, dtype="bfloat16"), prefill_chunk=64)
    session = engine.new_session("full")
    engine.turn(session, DOCUMENT, SamplingParams(max_new_tokens=1, temperature=0.0))
    by_c = blocks_written(session.cache, 42, 4)  # rows 8..49 of 50: blocks of rows 8..47
    with monkeypatch.context() as patch:
        patch.setattr(block_copy, "available", lambda: False)
        by_torch = blocks_written(session.cache, 42, 4)
    assert len(by_c) == len(by_torch) == 10
    storages = set()
    for c_data, torch_data in zip(by_c, by_torch, strict=True):
        c_block, torch_block = Block(b"", None, "acme", c_data), Block(b"", None, "acme", torch_data)
        assert len(c_block.rows) == len(session.cache.layers) and c_block.nbytes == torch_block.nbytes
        for (kc, vc), (kt, vt) in zip(c_block.rows, torch_block.rows, strict=True):
            assert kc.shape == kt.shape == (1, kt.shape[1], 4, kt.shape[-1])
            assert torch.equal(kc, kt) and torch.equal(vc, vt)
        assert c_block.addresses == array("q", [t.data_ptr() for kv in c_block.rows for t in kv]).tobytes()
        block_storages = {t.untyped_storage().data_ptr() for kv in c_block.rows for t in kv}
        assert len(block_storages) == 1  # one allocation a block
        storages |= block_storages
    assert len(storages) == 10
    first_layer = session.cache.layers[0]
    first_rows = Block(b"", None, "acme", by_c[0]).rows[0][0]
    assert torch.equal(first_rows, first_layer._k[:, :, first_layer._end - 42 : first_layer._end - 38])
