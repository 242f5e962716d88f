"""A session starting from shared prefix blocks (engine/cache.py ``fill_prefix``): the C copy
of bf16 blocks into buffers with spare rows gives the cache one concatenation per layer gives,
bit for bit (a sliding layer's window too), appends go in place after it, and a later chat's
answer on a shared document is the same either way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsnap.engine import Engine, SamplingParams, cache, kernels, load_model
from kvsnap.engine.cache import BlockRows, CompressedLayer, export_kv, fill_prefix
from kvsnap.policies import make_policy

from .conftest import random_tokens

pytestmark = pytest.mark.skipif(kernels.kernel() is None, reason="no C compiler: only the concatenation runs")

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


def test_the_c_copy_equals_the_concatenation_and_appends_go_in_place(bf16_sharing):
    engine = bf16_sharing
    later_chat(engine, random_tokens(5, seed=1))  # the document's blocks
    blocks = engine.prefixes.lookup("acme", DOCUMENT, len(DOCUMENT))
    assert len(blocks) == 12
    by_c, by_cat = engine.new_session("full").cache, engine.new_session("full").cache
    fill_prefix(by_c, [b.rows for b in blocks], 20, [b.addresses for b in blocks])
    fill_prefix(by_cat, [b.rows for b in blocks])
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
    session_c, by_c = later_chat(engine, question)
    monkeypatch.setattr(cache, "kernels", SimpleNamespace(kernel=lambda: None))  # the fill alone: concatenations
    session_cat, by_cat = later_chat(engine, question)
    assert by_c.report.cached_tokens == by_cat.report.cached_tokens == 48
    assert by_c.tokens == by_cat.tokens
    for ka, kb in zip(export_kv(session_c.cache), export_kv(session_cat.cache), strict=True):
        assert torch.equal(ka, kb)


def test_rows_off_the_host_are_concatenated_never_copied_in_c(monkeypatch):
    """The C copy reads and writes host memory: a GPU's (here: meta) blocks take the concatenation."""

    def never(*args):
        raise AssertionError("the C copy ran on rows off the host")

    monkeypatch.setattr(kernels, "gather_blocks", never)
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=16)
    heads, dim = engine.model.config.num_key_value_heads, engine.model.config.head_dim
    layers = engine.model.config.num_hidden_layers
    row = torch.empty(1, heads, 4, dim, dtype=torch.bfloat16, device="meta")
    blocks = [[(row, row) for _ in range(layers)] for _ in range(3)]
    cache_ = engine.new_session("full").cache
    fill_prefix(cache_, blocks, 8, [b"\0" * 16 * layers for _ in blocks])
    assert all(layer.keys.device.type == "meta" and layer.keys.shape[-2] == 12 for layer in cache_.layers)
