"""A one-token row's attention in bf16 on a CPU (engine/batch.py ``one_token_attention``): what
torch's SDPA computes, and the path every decode row of a bf16 step takes."""

from __future__ import annotations

import threading

import pytest
import torch

from kvsnap.cpu_kernels import decode_attention
from kvsnap.engine import SamplingParams
from kvsnap.policies import make_policy

from ..conftest import random_tokens


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

    monkeypatch.setattr(
        batch.decode_attention, "available", lambda: False
    )  # the torch path (the kernel's test is below)
    monkeypatch.setattr(
        batch.chunk_attention, "available", lambda variant=None: False
    )  # and SDPA for chunks (tests/cpu_kernels/test_chunk_attention.py)
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


needs_kernel = pytest.mark.skipif(not decode_attention.available(), reason="KVSNAP_C_KERNELS=0: the torch path runs")


@needs_kernel
@pytest.mark.parametrize("dim", [64, 256])
def test_kernel_is_one_token_attention_within_float32_rounding(dim):
    """cpu_kernels/decode_attention.py's C kernel, rows of different lengths in one call (one on a strided
    view of a longer buffer, as a cache layer holds), against the torch path row by row."""
    from kvsnap.engine.batch import one_token_attention

    gen = torch.Generator().manual_seed(3)
    queries, keys, values = [], [], []
    for n in (1, 37, 300):
        queries.append((torch.randn(1, 8, 1, dim, generator=gen) * 2).bfloat16())
        buf = (torch.randn(2, 1, 2, n + 5, dim, generator=gen) * 2).bfloat16()
        keys.append(buf[0, :, :, :n])  # a view: head stride (n + 5) * dim
        values.append(buf[1, :, :, :n])
    assert all(decode_attention.takes(q, k, v) for q, k, v in zip(queries, keys, values, strict=True))
    got = decode_attention.one_token_rows(queries, keys, values, 0.1)
    for q, k, v, out in zip(queries, keys, values, got, strict=True):
        want = one_token_attention(q, k, v, 0.1)
        assert out.shape == want.shape == (1, 1, 8, dim) and out.dtype == torch.bfloat16
        # both accumulate in float32; they differ by the order of the sums, then one bf16 rounding
        assert (out.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


@needs_kernel
def test_kernel_takes_every_decode_row_of_a_layer_in_one_call_and_answers_as_torch(tiny_engine, monkeypatch):
    """With the kernel, a bf16 step's one-token rows go to it in one call per layer, and a
    batch of greedy turns gives the tokens the torch path gives."""
    from kvsnap.engine import Engine, batch, load_model
    from kvsnap.engine.scheduler import Scheduler

    def tokens(use_kernel: bool) -> tuple[list[list[int]], list[int]]:
        calls = []
        real = decode_attention.attend  # what one_token_rows and cpu_kernels/decode_rows.py call
        with monkeypatch.context() as m:
            if not use_kernel:
                m.setattr(batch.decode_attention, "available", lambda: False)
            m.setattr(decode_attention, "attend", lambda q, rows, *a: (calls.append(len(rows)), real(q, rows, *a))[1])
            engine = Engine(load_model(tiny_engine.loaded.name, dtype="bfloat16"), prefill_chunk=64)
            scheduler = Scheduler(engine, threading.RLock(), max_batch=4, start=False)
            params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0)
            jobs = []
            for i in range(3):
                session = engine.new_session(make_policy("full"))
                jobs.append(
                    scheduler.submit(scheduler.job(engine.start(session, random_tokens(30 + 7 * i, seed=i), params)))
                )
            while not all(job.ended.is_set() for job in jobs):
                scheduler.run_step()
            out = [list(job) for job in jobs]
        return out, calls

    torch_tokens, torch_calls = tokens(False)
    kernel_tokens, kernel_calls = tokens(True)
    assert torch_calls == [] and kernel_calls and max(kernel_calls) > 1  # rows of a layer share a call
    assert kernel_tokens == torch_tokens
