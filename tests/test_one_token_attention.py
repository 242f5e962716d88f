"""A one-token row's attention in bf16 on a CPU (engine/batch.py ``one_token_attention``): what
torch's SDPA computes, and the path every decode row of a bf16 step takes."""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine import SamplingParams
from kvsnap.policies import make_policy

from .conftest import random_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_attention_is_sdpa_within_the_outputs_rounding(dtype):
    """A bf16 decode row on a CPU skips torch's flash kernel (engine/batch.py): grouped-query
    attention of one token over 300 rows, against float64 SDPA, errs no more than SDPA itself
    does in that dtype, plus one rounding of the output."""
    import torch.nn.functional as F

    from kvsnap.engine.batch import one_token_attention

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) * 2 for h, n in ((8, 1), (2, 300), (2, 300)))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.1, enable_gqa=True)
    want = want.transpose(1, 2)  # [1, 1, H, D], as attention functions return
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.1, enable_gqa=True).transpose(1, 2)
    ours = one_token_attention(q, k, v, 0.1)
    assert ours.shape == want.shape and ours.dtype == dtype
    ulp = 1e-6 if dtype == torch.float32 else 2**-8
    assert (ours.double() - want).abs().max() <= (sdpa.double() - want).abs().max() + ulp * want.abs().max()


def test_bf16_decode_rows_take_one_token_attention_and_prompt_chunks_sdpa(tiny_engine, monkeypatch):
    """In a bf16 packed step on a CPU every one-token row goes through one_token_attention, and
    a prompt chunk's rows through SDPA with their causal mask."""
    from kvsnap.engine import Engine, batch, load_model

    engine = Engine(load_model(tiny_engine.loaded.name, dtype="bfloat16"), prefill_chunk=16)
    calls = []
    real = batch.one_token_attention
    monkeypatch.setattr(batch, "one_token_attention", lambda q, *a: (calls.append(q.shape[-2]), real(q, *a))[1])
    session = engine.new_session(make_policy("full"))
    engine.prefill(session, random_tokens(40, seed=5))
    assert calls == []  # chunks of 16, 16 and 8 tokens: SDPA
    engine.turn(session, random_tokens(3, seed=6), SamplingParams(max_new_tokens=4, ignore_eos=True))
    layers = engine.model.config.num_hidden_layers
    assert calls == [1] * (3 * layers)  # the turn's 3 decode steps (its 4th token stays pending)
