"""A decode step's projections on AMX tiles (cpu_kernels/linear_tiles.py): oneDNN's bits, every row count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvsnap.cpu_kernels import linear_tiles
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.models import packed
from kvsnap.engine.models.packed import can_pack, pack_linears, uses_amx
from kvsnap.policies import make_policy

from ..conftest import random_tokens

needs_amx = pytest.mark.skipif(not linear_tiles.available(), reason="no AMX on this CPU")
ONEDNN = lambda x, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731

# (out, in) of every projection of the two embedded models
SHAPES = {
    "smollm2-135m": [(576, 576), (192, 576), (1536, 576), (576, 1536)],
    "gemma3-270m": [(1024, 640), (256, 640), (640, 1024), (2048, 640)],  # (640, 2048): oneDNN's (below)
}


@needs_amx
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_every_row_count_gives_onednns_bits_on_the_embedded_models_shapes(model):
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in SHAPES[model]:
        weight = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).to(torch.bfloat16)
        assert linear_tiles.takes(weight)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        x = (torch.randn(linear_tiles.MAX_ROWS, in_features, generator=gen) * 3).to(torch.bfloat16)
        for rows in range(1, linear_tiles.MAX_ROWS + 1):
            got = linear_tiles.linear(x[:rows], weight)
            assert torch.equal(got, ONEDNN(x[:rows], onednn)), (out_features, in_features, rows)
        # a row's result does not depend on the rows beside it
        alone = torch.cat([linear_tiles.linear(x[i : i + 1], weight) for i in range(len(x))])
        assert torch.equal(alone, linear_tiles.linear(x, weight))


@needs_amx
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_lm_heads_first_pass_is_f_linears(model):
    head = load_model(model, dtype="bfloat16").model.get_output_embeddings().weight.detach()
    assert linear_tiles.takes(head)
    x = torch.randn(8, head.shape[1]).to(torch.bfloat16)
    assert torch.equal(linear_tiles.linear(x, head), nn.functional.linear(x, head))


@needs_amx
def test_a_three_dimensional_input_and_torch_thread_counts():
    weight = torch.randn(128, 64).to(torch.bfloat16)
    x = torch.randn(1, 5, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(linear_tiles.linear(x, weight))
    finally:
        torch.set_num_threads(threads)
    assert results[0].shape == (1, 5, 128) and torch.equal(results[0], results[1])
    assert torch.equal(results[0][0], nn.functional.linear(x[0], weight))


@needs_amx
def test_what_it_does_not_take():
    assert not linear_tiles.takes(torch.zeros(100, 64, dtype=torch.bfloat16))  # 100 outputs: not groups of 64
    assert not linear_tiles.takes(torch.zeros(64, 48, dtype=torch.bfloat16))  # 48 inputs: not tiles of 32
    assert not linear_tiles.takes(torch.zeros(64, 64))  # float32
    assert not linear_tiles.takes(torch.zeros(640, 2048, dtype=torch.bfloat16))  # rows 4 KiB apart: L1 set conflicts
    assert not linear_tiles.takes(torch.zeros(64, 128, dtype=torch.bfloat16)[:, ::2])  # not contiguous
    rows = torch.zeros(17, 64, dtype=torch.bfloat16)
    assert not linear_tiles.fits(rows) and linear_tiles.fits(rows[:16]) and not linear_tiles.fits(rows[:0])
    assert not linear_tiles.fits(rows[:4, ::2])  # not contiguous


@needs_amx
@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 kernels")
def test_a_model_decodes_with_the_tiles_and_answers_as_with_onednn():
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=16)
    layers = [m for m in engine.model.modules() if type(m) is nn.Linear and uses_amx(m)]
    assert layers  # the tiny model's projections have the kernel's shapes
    prompts = [random_tokens(40, seed=s) for s in (1, 2, 3)]
    sampling = SamplingParams(max_new_tokens=10)
    with_tiles = [engine.turn(engine.new_session(make_policy("full")), p, sampling).tokens for p in prompts]
    packed.AMX_MAX_ROWS = 0  # the same packed model, oneDNN for every product
    try:
        plain = [engine.turn(engine.new_session(make_policy("full")), p, sampling).tokens for p in prompts]
    finally:
        packed.AMX_MAX_ROWS = linear_tiles.MAX_ROWS
    assert with_tiles == plain
    assert pack_linears(engine.model) == 0  # idempotent


@needs_amx
def test_several_weights_in_one_pass_give_each_ones_own_bits():
    gen = torch.Generator().manual_seed(1)
    weights = [(torch.randn(n, 576, generator=gen) * 0.04).to(torch.bfloat16) for n in (576, 192, 192)]
    for rows in (1, 5, 16):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        together = linear_tiles.linears(x, weights)
        assert [t.shape for t in together] == [(rows, 576), (rows, 192), (rows, 192)]
        for got, weight in zip(together, weights, strict=True):
            assert torch.equal(got, linear_tiles.linear(x, weight))
    with pytest.raises(ValueError):
        linear_tiles.linears(x, weights * 3)  # more than MAX_WEIGHTS


@needs_amx
def test_a_layers_projections_go_together_only_where_each_takes_the_tiles():
    model = load_model("smollm2-135m", dtype="bfloat16").model
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 8, 576).to(torch.bfloat16)
    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    together = packed.products(modules, x)
    assert all(torch.equal(t, m(x)) for t, m in zip(together, modules, strict=True))
    packed.AMX_MAX_ROWS = 0  # oneDNN's products, one by one: the same bits
    try:
        assert all(torch.equal(t, o) for t, o in zip(together, packed.products(modules, x), strict=True))
    finally:
        packed.AMX_MAX_ROWS = linear_tiles.MAX_ROWS
