"""A prompt chunk's attention in a packed step on a CPU (engine/batch.py ``mask`` and
``sdpa_chunk_attention``): the same numbers, bit for bit, as transformers' SDPA path with a boolean
mask, in less time (no mask where plain causal attention is meant, no per-head copies)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsnap.engine.batch import mask, sdpa_chunk_attention


class Module(torch.nn.Module):
    """What transformers' SDPA wrapper reads of an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def boolean(q: int, k: int, window: int | None) -> torch.Tensor:
    i = torch.arange(q)[:, None] + (k - q)
    j = torch.arange(k)[None]
    visible = (j <= i) & ((j > i - window) if window is not None else True)
    return visible[None, None]


@pytest.mark.parametrize(("q", "k", "window"), [(5, 9, None), (7, 7, 4), (6, 30, 8), (3, 3, None), (1, 12, None)])
def test_mask_hides_what_the_boolean_mask_hides(q, k, window):
    got = mask(q, k, window, torch.empty(0, dtype=torch.bfloat16))
    if q == 1 or (q == k and window is None):
        assert got is None  # one token sees every row; a first chunk is plain causal
        return
    assert got.shape == (1, 1, q, k) and got.dtype == torch.bfloat16
    assert torch.equal(got == 0, boolean(q, k, window))
    assert torch.isinf(got[got != 0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q", "k"), [(40, 40), (40, 100), (1, 50)])
def test_chunk_attention_equals_transformers_sdpa_bit_for_bit(dtype, q, k):
    """Grouped-query heads (8 query heads on 2 KV heads), a chunk at the end of its rows: the
    additive mask (or none: a first chunk is causal) and shared KV heads give the numbers of
    transformers' wrapper with the boolean mask and repeated keys and values (one token: no
    mask either way)."""
    gen = torch.Generator().manual_seed(5)
    query = (torch.randn(1, 8, q, 32, generator=gen) * 2).to(dtype)
    keys, values = ((torch.randn(1, 2, k, 32, generator=gen) * 2).to(dtype) for _ in range(2))
    want_mask = None if q == 1 else boolean(q, k, None)
    want, _ = sdpa_attention_forward(Module(4), query, keys, values, want_mask, scaling=0.2)
    got, _ = sdpa_chunk_attention(Module(4), query, keys, values, mask(q, k, None, query), scaling=0.2)
    assert got.shape == want.shape == (1, q, 8, 32)
    assert torch.equal(got, want)
