"""Packed bf16 linear weights (engine/models/packed.py): the same numbers as ``F.linear``, faster."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kvsnap.cpu_kernels import linear_tiles
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.models import fused, lean, packed
from kvsnap.engine.models.packed import can_pack, is_grouped, is_packed, pack_linears, unpack_linears
from kvsnap.policies import make_policy

from ...conftest import random_tokens

needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 kernels on this CPU"
)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def _groups_here(modules) -> bool:
    """Whether this CPU groups ``modules``: not where the AMX tiles take their weights (oneDNN's
    AMX kernels sum a stacked weight in another order at some row counts, packed.group)."""
    return not any(linear_tiles.takes(m.weight) for m in modules)


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


# the embedded models' projections taken together: SmolLM2's query / key / value and gate / up,
# Gemma 3's gate / up (its attention keeps transformers' layer, which calls each alone)
GROUPS = {"smollm2-qkv": (576, (576, 192, 192)), "smollm2-mlp": (576, (1536, 1536)), "gemma3-mlp": (640, (2048, 2048))}


@needs_bf16
@pytest.mark.parametrize("shape", list(GROUPS))
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_projections_give_each_ones_own_bits_at_every_row_count(shape, bias):
    width, outs = GROUPS[shape]
    gen = torch.Generator().manual_seed(7)
    modules = tuple(nn.Linear(width, n, bias=bias).to(torch.bfloat16) for n in outs)
    with torch.no_grad():
        for m in modules:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.04)
    pack_linears(nn.Sequential(*modules))
    grouped = packed.group(modules)
    assert grouped == _groups_here(modules) and all(is_grouped(m) == grouped and is_packed(m) for m in modules)
    with torch.inference_mode():
        for rows in (*range(1, 41), 64, 333, 1024):
            x = torch.randn(1, rows, width, generator=gen).to(torch.bfloat16)
            together = packed.products(modules, x)
            assert [t.shape for t in together] == [(1, rows, n) for n in outs]
            for got, m in zip(together, modules, strict=True):
                want = nn.functional.linear(x, m.weight, m.bias)
                if _groups_here(modules):
                    assert torch.equal(got, want), (rows, m)
                else:  # AMX: oneDNN's packed kernels round otherwise at some row counts (333 here)
                    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)
                assert torch.equal(m(x), got)  # one module called alone: the same bits
        packed.ungroup(modules)
        assert not any(is_grouped(m) for m in modules) and all(is_packed(m) for m in modules)
        x = torch.randn(8, width, generator=gen).to(torch.bfloat16)
        assert all(torch.equal(m(x), nn.functional.linear(x, m.weight, m.bias)) for m in modules)


@needs_bf16
def test_a_group_needs_every_module_packed_and_one_kind_of_bias():
    a, b = nn.Linear(64, 32, bias=True).to(torch.bfloat16), nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    pack_linears(nn.Sequential(a, b))
    assert not packed.group((a, b)) and not is_grouped(a)  # one bias, one without: each stays packed alone
    c = nn.Linear(64, 32).to(torch.bfloat16)  # never packed
    assert not packed.group((a, c)) and is_packed(a)


@needs_bf16
def test_a_bf16_llama_groups_its_projections_and_ungroups_when_uninstalled():
    model = load_model("tiny-llama", dtype="bfloat16").model
    layer = model.model.layers[0]
    grouped = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
    grouped += (layer.mlp.gate_proj, layer.mlp.up_proj)
    here = _groups_here(grouped)
    assert all(is_grouped(m) == here for m in grouped) and not is_grouped(layer.mlp.down_proj)
    assert (grouped[:3] in packed.groups(model) and grouped[3:] in packed.groups(model)) == here
    ids = torch.tensor([random_tokens(40, seed=3)])
    with torch.inference_mode():
        out = model(ids).logits
        lean.uninstall(model)
        fused.unfuse(model)
        assert not any(is_grouped(m) for m in _linears(model)) and all(is_packed(m) for m in grouped)
        assert torch.equal(model(ids).logits, out)


@needs_bf16
def test_unpacking_and_packing_again_forms_the_groups_again():
    model = load_model("tiny-llama", dtype="bfloat16").model
    attn = model.model.layers[1].self_attn
    unpack_linears(model)
    assert not any(is_packed(m) for m in _linears(model))
    pack_linears(model)
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    assert all(is_grouped(m) == _groups_here(projections) for m in projections)
