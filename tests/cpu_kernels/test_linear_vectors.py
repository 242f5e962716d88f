"""cpu_kernels/linear_vectors.py: a step's one-token rows on AVX-512 BF16 vectors, and how engine/models/packed.py
gives it those rows only (a row's products depend on the row alone).

The kernel is not oneDNN's bits, so these check what the engine relies on instead: its sums are
bf16 roundings of float32 sums (within the bound of the inputs' products), a row's result is
the same bits alone, beside any number of other rows and on any thread count, and in a packed
step a one-token row gets the kernel's bits and a prompt chunk oneDNN's, whatever shares the
step. (tests/engine/test_continuous_batching.py and the replay tests run the tiny models, whose shapes the kernel
takes, through the whole engine.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvsnap.cpu_kernels import linear_vectors
from kvsnap.engine.models import packed

pytestmark = pytest.mark.skipif(not linear_vectors.available(), reason="no AVX-512 BF16 kernel (or AMX) here")

# SmolLM2's and Gemma 3 270M's projection shapes (N, K), and a tiny model's
SHAPES = [(960, 576), (3072, 576), (576, 1536), (1536, 640), (640, 2048), (96, 64)]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_float32_sums_rounded_once_to_bf16(shape):
    out_features, in_features = shape
    torch.manual_seed(0)
    w = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    x = torch.randn(5, in_features).bfloat16()
    got = linear_vectors.linears(x, [linear_vectors.repack(w)])[0]
    assert got.shape == (5, out_features) and got.dtype == torch.bfloat16
    exact = _reference(x, w)
    # float32 accumulation over K terms, then one bf16 rounding
    scale = (x.double().abs() @ w.double().abs().T) * in_features * 2.0**-24
    assert ((got.double() - exact).abs() <= scale + exact.abs() * 2.0**-8).all()
    # and oneDNN's product is as close: the same sums in another order
    onednn = torch.nn.functional.linear(x, w)
    assert (got.double() - onednn.double()).abs().max() <= 2 * (scale + exact.abs() * 2.0**-8).max()


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_a_rows_result_depends_on_neither_its_neighbours_nor_their_count_nor_threads(shape):
    out_features, in_features = shape
    torch.manual_seed(1)
    w = linear_vectors.repack((torch.randn(out_features, in_features) * 0.05).bfloat16())
    rows = torch.randn(20, in_features).bfloat16()
    alone = torch.cat([linear_vectors.linears(rows[i : i + 1], [w])[0] for i in range(20)])
    for count in (2, 7, 8, 9, 16, 20):
        assert torch.equal(linear_vectors.linears(rows[:count], [w])[0], alone[:count]), count
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)  # the kernel's OpenMP team is the caller's
            assert torch.equal(linear_vectors.linears(rows[:8], [w])[0], alone[:8]), n
    finally:
        torch.set_num_threads(before)


def test_several_weights_in_one_call_give_each_its_own_product():
    torch.manual_seed(2)
    ws = [(torch.randn(n, 576) * 0.05).bfloat16() for n in (576, 192, 192)]
    x = torch.randn(3, 576).bfloat16()
    together = linear_vectors.linears(x, [linear_vectors.repack(w) for w in ws])
    for w, got in zip(ws, together, strict=True):
        assert torch.equal(got, linear_vectors.linears(x, [linear_vectors.repack(w)])[0])
    with pytest.raises(ValueError):
        linear_vectors.linears(x, [])


def _packed_linear(out_features: int, in_features: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(3)
    module = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16).eval()
    holder = nn.Sequential(module)
    packed.pack_linears(holder)
    assert packed.uses_few(module)
    return module


def test_in_a_packed_step_one_token_rows_take_the_kernel_and_prompt_chunks_onednn():
    module = _packed_linear(192, 576)
    weight = module.weight.detach()
    tokens = torch.randn(1, 1 + 5 + 1 + 1, 576).bfloat16()  # rows of 1, 5, 1 and 1 tokens
    with torch.inference_mode(), packed.step_rows([1, 5, 1, 1]):
        out = module(tokens)
    singles = [0, 6, 7]
    expect_singles = linear_vectors.linears(tokens[0, singles], [linear_vectors.repack(module.weight)])[0]
    assert torch.equal(out[0, singles], expect_singles)
    assert torch.equal(out[0, 1:6], torch.nn.functional.linear(tokens[0, 1:6], weight))
    # a decode step alone: the same bits for each row as beside the chunk
    with torch.inference_mode(), packed.step_rows([1, 1, 1]):
        alone = module(tokens[:, singles])
    assert torch.equal(alone[0], expect_singles)
    # outside a step (a reference forward, a capture's own pass): oneDNN for every row
    with torch.inference_mode():
        assert torch.equal(module(tokens), torch.nn.functional.linear(tokens, weight))
    packed.FEW_ROWS = False
    try:
        with torch.inference_mode(), packed.step_rows([1, 1, 1]):
            assert torch.equal(module(tokens[:, singles]), torch.nn.functional.linear(tokens[:, singles], weight))
    finally:
        packed.FEW_ROWS = True


def test_a_biased_projection_takes_the_kernel_and_adds_its_bias():
    """Qwen2's query, key and value projections have biases: their one-token rows take the kernel
    too, the bias added after it (within a bf16 step of oneDNN's, which adds it before rounding)."""
    module = _packed_linear(192, 576, bias=True)
    weight, bias = module.weight.detach(), module.bias.detach()
    tokens = torch.randn(1, 1 + 5 + 1, 576).bfloat16()  # rows of 1, 5 and 1 tokens
    with torch.inference_mode(), packed.step_rows([1, 5, 1]):
        out = module(tokens)
    singles = [0, 6]
    kernel = linear_vectors.linears(tokens[0, singles], [linear_vectors.repack(weight)])[0]
    assert torch.equal(out[0, singles], kernel + bias)
    assert torch.equal(out[0, 1:6], torch.nn.functional.linear(tokens[0, 1:6], weight, bias))
    reference = torch.nn.functional.linear(tokens[0, singles].float(), weight.float(), bias.float())
    torch.testing.assert_close(out[0, singles].float(), reference, rtol=2**-7, atol=2**-7)
    with torch.inference_mode(), packed.step_rows([1, 1]):  # a decode step alone: the same bits
        assert torch.equal(module(tokens[:, singles])[0], kernel + bias)
