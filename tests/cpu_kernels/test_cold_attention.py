"""The one-token kernel over a mixed-precision layer (cpu_kernels/cold_attention.py): quantized
rows read where they lie equal the torch path (every row dequantized, then the bf16 rows, one
attention) within float32 rounding order, on every variant this CPU runs; and a decode step
of a mixed session takes it."""

from __future__ import annotations

import pytest
import torch

from kvsnap.cpu_kernels import build, cold_attention
from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.engine.batch import one_token_attention
from kvsnap.engine.cold import ColdRows
from kvsnap.policies import make_policy
from kvsnap.policies.kivi import KIVI, dequantize

from ..conftest import random_tokens


def layer_rows(seed: int, kv_heads: int, dim: int, bits: int, sizes: tuple[int, ...], kept: int):
    """A layer's cold segments of ``sizes`` rows (a segment under 32 rows stays unquantized) and
    ``kept`` bf16 rows, as views of a larger buffer (a cache layer's head stride)."""
    gen = torch.Generator().manual_seed(seed)
    cold = ColdRows()
    for n in sizes:
        k, v = (torch.randn(1, kv_heads, n, dim, generator=gen).to(torch.bfloat16) * 2 for _ in range(2))
        cold.add(KIVI(bits=bits, group=32, residual=0), k, v)
    buf = torch.randn(2, kv_heads, kept + 40, dim, generator=gen).to(torch.bfloat16)
    return cold, buf[0:1, :, :kept], buf[1:2, :, :kept]


def exact_rows(cold: ColdRows, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the layer in float64: the cold ones dequantized without a rounding."""
    out = []
    for parts, meta in [(k, km) for k, km, _, _ in cold.segments] + [(v, vm) for _, _, v, vm in cold.segments]:
        if meta["kind"] == "raw":
            out.append(parts[0].double())
        else:
            out.append(dequantize([*parts[:3], parts[3].double()], meta | {"dtype": "torch.float64"}))
    n = len(cold.segments)
    return torch.cat([*out[:n], keys.double()], 2), torch.cat([*out[n:], values.double()], 2)


@pytest.mark.parametrize("variant", build.runnable() or [None])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256), (14, 2, 64), (8, 2, 48)])
def test_the_kernel_equals_dequantizing_every_row(variant, bits, heads, kv_heads, dim):
    if variant is None:
        pytest.skip("no kernel variant runs here")
    layers = [
        layer_rows(1, kv_heads, dim, bits, (300, 70), kept=40),  # two segments, each with unquantized rows
        layer_rows(2, kv_heads, dim, bits, (20,), kept=7),  # a segment too short to quantize
        layer_rows(3, kv_heads, dim, bits, (64,), kept=1),
    ]
    gen = torch.Generator().manual_seed(9)
    queries = [torch.randn(1, heads, 1, dim, generator=gen).to(torch.bfloat16) for _ in layers]
    with build.use(variant):
        views = [cold_attention.segments(cold) for cold, _, _ in layers]
        assert all(view is not None for view in views)
        got = cold_attention.one_token_rows(queries, [k for _, k, _ in layers], [v for _, _, v in layers], views, 0.125)
    for q, (cold, k, v), out in zip(queries, layers, got, strict=True):
        want = one_token_attention(q, *cold.before(k, v), 0.125)
        assert out.shape == want.shape == (1, 1, heads, dim) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2**-7 * want.abs().max().item())
        # against the rows dequantized in float64: no further off than the torch path (which
        # rounds each dequantized value to bf16; the kernel never does), plus one output rounding
        exact = one_token_attention(q.double(), *exact_rows(cold, k, v), 0.125)
        ulp = 2**-8 * exact.abs().max()
        assert (out.double() - exact).abs().max() <= (want.double() - exact).abs().max() + ulp


def test_rows_the_kernel_cannot_read_are_said_so():
    cold = ColdRows()
    rows = torch.randn(1, 2, 64, 16)
    cold.add(KIVI(bits=4, group=32, residual=0), rows, rows)  # float32: the torch path
    assert cold_attention.segments(cold) is None
    grouped = ColdRows()
    grouped.add(KIVI(bits=4, group=16, residual=0), rows.bfloat16(), rows.bfloat16())  # key groups of 16 rows
    assert cold_attention.segments(grouped) is None
    mixed = ColdRows()
    for bits in (4, 2):  # segments of either number of bits, in one layer
        mixed.add(KIVI(bits=bits, group=32, residual=0), rows.bfloat16(), rows.bfloat16())
    assert [seg.bits for seg in cold_attention.segments(mixed)] == [4, 2]


def test_a_mixed_decode_step_takes_the_kernel_and_answers_as_the_torch_path(monkeypatch):
    if not cold_attention.available():
        pytest.skip("no kernel variant runs here")
    engine = Engine(load_model("tiny-llama", dtype="bfloat16"), prefill_chunk=16)
    policy = make_policy("snapkv", budget=16, window=8, rest="kivi4")
    calls = []
    real = cold_attention.one_token_rows
    monkeypatch.setattr(cold_attention, "one_token_rows", lambda *a: calls.append(len(a[0])) or real(*a))
    sampling = SamplingParams(max_new_tokens=8)
    prompt = random_tokens(150, seed=4)
    with_kernel = engine.turn(engine.new_session(policy), prompt, sampling)
    assert calls and max(calls) >= 1
    monkeypatch.setattr(cold_attention, "available", lambda: False)
    calls.clear()
    without = engine.turn(engine.new_session(policy), prompt, sampling)
    assert not calls
    # the same tokens: within float32 rounding order, a random model's greedy choices agree here
    assert with_kernel.tokens == without.tokens
