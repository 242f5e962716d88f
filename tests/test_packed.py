"""Packed bf16 linear weights (engine/packed.py): the same numbers as ``F.linear``, faster."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.packed import can_pack, is_packed, pack_linears, unpack_linears
from kvsnap.policies import make_policy

from .conftest import random_tokens

needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 kernels on this CPU"
)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


@needs_bf16
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_bf16_model_loads_packed_and_its_logits_are_bit_equal(name):
    model = load_model(name, dtype="bfloat16").model
    head = model.get_output_embeddings()
    packed = [m for m in _linears(model) if is_packed(m)]
    assert packed and head not in packed and len(packed) == len(_linears(model)) - 1  # all but the LM head
    assert pack_linears(model) == 0  # idempotent
    ids = torch.tensor([random_tokens(40, seed=3)])
    with torch.inference_mode():
        out = model(ids).logits
        unpack_linears(model)
        assert not any(is_packed(m) for m in _linears(model))
        ref = model(ids).logits
    assert torch.equal(out, ref)


@needs_bf16
def test_packed_rows_do_not_depend_on_how_many_share_the_product():
    layer = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(33, 64, dtype=torch.bfloat16)
    pack_linears(nn.Sequential(layer))  # a lone layer: nothing is an LM head
    with torch.inference_mode():
        rows = [layer(x[i : i + 1]) for i in range(len(x))]
        together = layer(x)
        assert torch.equal(torch.cat(rows), together)
        assert torch.equal(together, nn.functional.linear(x, layer.weight, layer.bias))


def test_float32_models_are_left_alone():
    model = load_model("tiny-llama").model  # float32 (the tiny presets' auto)
    assert pack_linears(model) == 0
    assert not any(is_packed(m) for m in _linears(model))


@needs_bf16
def test_a_packed_engines_greedy_turn_equals_the_unpacked_ones():
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=16)
    prompt, sampling = random_tokens(70, seed=5), SamplingParams(max_new_tokens=12)
    packed = engine.turn(engine.new_session(make_policy("full")), prompt, sampling).tokens
    unpack_linears(engine.model)
    plain = engine.turn(engine.new_session(make_policy("full")), prompt, sampling).tokens
    assert packed == plain


@needs_bf16
def test_a_packed_model_deep_copies_and_the_copy_answers_the_same():
    model = load_model("tiny-llama", dtype="bfloat16").model
    twin = copy.deepcopy(model)  # the packed weights are opaque: the copy takes plain products
    assert not any(is_packed(m) for m in _linears(twin))
    ids = torch.tensor([random_tokens(30, seed=4)])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, twin(ids).logits)
