"""SnapKV's votes in C (cpu_kernels/snapkv_votes.py): the sums torch's path computes, within float32
rounding, on GQA and plain shapes, short and long windows; the same bits on any thread count;
and a SnapKV selection in bf16 keeps the rows torch's path keeps."""

from __future__ import annotations

import pytest
import torch

from kvsnap.cpu_kernels import snapkv_votes
from kvsnap.policies import make_policy
from kvsnap.policies.base import window_attention, window_votes

pytestmark = pytest.mark.skipif(not snapkv_votes.available(), reason="no C compiler or no AVX-512 BF16 here")

SHAPES = [  # query heads, KV heads, head dim, window, rows
    (9, 3, 64, 32, 2460),  # SmolLM2's layers, a 2.4K-token prompt
    (4, 1, 256, 32, 700),  # Gemma 3 270M's
    (8, 8, 32, 5, 40),
    (9, 3, 64, 32, 33),  # one row before the window
    (6, 2, 64, 17, 300),  # a window that is not a multiple of 16
    (2, 1, 64, 1, 129),
]


def inputs(heads: int, kv_heads: int, dim: int, w: int, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, w, dim, generator=gen) * 2).bfloat16()
    k = (torch.randn(1, kv_heads, rows, dim, generator=gen) * 2).bfloat16()
    return q, k


@pytest.mark.parametrize("shape", SHAPES)
def test_the_votes_are_torchs_within_float32_rounding(shape):
    q, k = inputs(*shape)
    scale = shape[2] ** -0.5
    want = window_attention(q, k, scale)[..., : shape[4] - shape[3]].sum(dim=-2)
    got = snapkv_votes.votes(q, k, scale)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(window_votes(q, k, scale), got)  # the policies' entry point takes the kernel


def test_keys_in_a_buffer_with_room_after_them():
    """A session's layer holds its rows at the start of a longer buffer (room for new rows)."""
    q, _ = inputs(9, 3, 64, 32, 500)
    buffer = torch.randn(1, 3, 800, 64).bfloat16()
    keys = buffer[:, :, :500]
    torch.testing.assert_close(
        snapkv_votes.votes(q, keys, 0.125), snapkv_votes.votes(q, keys.contiguous(), 0.125), rtol=0, atol=0
    )


def test_the_same_bits_on_any_thread_count():
    q, k = inputs(9, 3, 64, 32, 1500, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = snapkv_votes.votes(q, k, 0.125)
        torch.set_num_threads(2)
        two = snapkv_votes.votes(q, k, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_snapkv_selection_keeps_the_rows_torchs_path_keeps(monkeypatch):
    q, k = inputs(9, 3, 64, 32, 1200, seed=5)
    policy = make_policy("snapkv", budget=300, window=32)
    got = policy.select(q, k, 0.125)
    monkeypatch.setattr(snapkv_votes, "takes", lambda *args: False)  # torch's path
    want = policy.select(q, k, 0.125)
    assert torch.equal(got, want)
