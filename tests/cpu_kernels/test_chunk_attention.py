"""A prompt chunk's attention in C (cpu_kernels/chunk_attention.py), each build this CPU runs (AMX tiles,
AVX-512 BF16 vectors): as close to exact attention as torch's SDPA is, the same causal and
sliding-window masks, a row's result independent of the rows beside it and of the thread count,
and the path a bf16 chunk takes on such a CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvsnap.cpu_kernels import build, chunk_attention, decode_attention
from kvsnap.engine.batch import mask

needs_kernel = pytest.mark.skipif(
    not chunk_attention.available(), reason="no AMX or AVX-512 BF16 on this CPU (or KVSNAP_C_KERNELS=0): SDPA runs"
)
VARIANTS = chunk_attention.variants() or ["avx512bf16"]  # the variants this CPU runs (skipped without one)
needs_kernels = pytest.mark.skipif(
    not decode_attention.available(), reason="KVSNAP_C_KERNELS=0: no kernel library loads"
)


def rows(heads: int, kv_heads: int, dim: int, count: int, length: int, seed: int):
    """A chunk's queries as the model hands them over (``[1, T, H, D]`` seen as ``[1, H, T, D]``)
    and its session's rows as cache views (``[1, H_kv, L, D]`` inside a longer buffer)."""
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(1, count, heads, dim, generator=gen) * 2).to(torch.bfloat16).transpose(1, 2)
    keys, values = (
        (torch.randn(1, kv_heads, length + 40, dim, generator=gen) * 2).to(torch.bfloat16)[:, :, 8 : 8 + length]
        for _ in range(2)
    )
    return query, keys, values


def exact(query, keys, values, scale, window):
    """Float64 attention with the chunk's mask (the last ``T`` of ``L`` rows): ``[1, T, H, D]``."""
    count, length = query.shape[2], keys.shape[2]
    hidden = mask(count, length, window, torch.empty(0, dtype=torch.float64))
    causal = hidden is None and count > 1
    out = F.scaled_dot_product_attention(
        query.double(), keys.double(), values.double(), attn_mask=hidden, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


# (heads, KV heads, head dim, chunk, rows, window): SmolLM2's and Gemma 3's shapes, a chunk after
# earlier rows, a first chunk, chunks shorter than a tile, windows cutting through key blocks,
# a last unit of one query over rows that end inside a 16-key group (with and without a window),
# and a window that leaves whole 256-key blocks behind
SHAPES = [
    (9, 3, 64, 300, 700, None),
    (9, 3, 64, 37, 1000, None),
    (9, 3, 64, 17, 40, None),
    (4, 1, 256, 100, 700, 512),
    (4, 1, 256, 33, 700, 512),
    (4, 1, 256, 200, 200, 64),
    (4, 1, 256, 64, 1000, 300),
    (2, 2, 32, 2, 2, None),
    (8, 2, 32, 17, 40, 8),
    (8, 2, 128, 5, 530, 300),
]


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "count", "length", "window"), SHAPES)
def test_kernel_errs_no_more_than_sdpa(heads, kv_heads, dim, count, length, window, flat, variant):
    """Against float64 attention, the kernel's bf16 output errs no more than SDPA's in bf16 does,
    plus one rounding of the output. ``flat``: a tiny scale makes the weights nearly uniform, so
    a key weighed that should not be (padding, a future row, one outside the window) or one left
    out moves the output by about its share of the rows."""
    query, keys, values = rows(heads, kv_heads, dim, count, length, seed=count)
    assert chunk_attention.takes(query, keys, values)
    scale = 1e-3 if flat else dim**-0.5
    want = exact(query, keys, values, scale, window)
    hidden = mask(count, length, window, query)
    sdpa = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=hidden, is_causal=hidden is None and count > 1, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    got = chunk_attention.attention(query, keys, values, scale, window, variant)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    allowed = (sdpa.double() - want).abs().max() + 2**-8 * want.abs().max()
    assert (got.double() - want).abs().max() <= allowed


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_querys_result_depends_on_nothing_but_its_own_rows(variant):
    """The same query gives the same bits in a chunk of 100, of 17 or of 7 (the chunk's last rows,
    the last one a unit of its own in the chunk of 17), and on one thread or two: each query is
    one unit's, over its rows in order."""
    query, keys, values = rows(8, 2, 64, 100, 905, seed=3)
    whole = chunk_attention.attention(query, keys, values, 0.125, None, variant)
    for tail in (17, 7, 4):
        part = chunk_attention.attention(query[:, :, -tail:], keys, values, 0.125, None, variant)
        assert torch.equal(whole[:, -tail:], part)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        other = chunk_attention.attention(query, keys, values, 0.125, None, variant)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(other, whole)


@needs_kernel
def test_a_bf16_chunk_takes_the_kernel_and_a_float32_one_sdpa(gemma_engine, gemma_fp32_engine, monkeypatch):
    """In a packed step, a bf16 chunk goes to the kernel (with its layer's window on Gemma 3's
    sliding layers) and the logits stay those of the SDPA path within bf16's drift; float32
    rows never reach it."""
    from kvsnap.engine import Engine, load_model
    from kvsnap.policies import make_policy

    from ..conftest import random_tokens

    calls = []
    real = chunk_attention.attention
    monkeypatch.setattr(
        chunk_attention, "attention", lambda q, k, v, s, w, **kw: (calls.append(w), real(q, k, v, s, w, **kw))[1]
    )
    tokens = random_tokens(700, seed=11, high=20000)

    def prefill(engine):
        return engine.prefill(engine.new_session(make_policy("full")), tokens).float().flatten()

    engine = gemma_engine  # chunks of 512: the second sees earlier rows, and the window cuts them
    if engine.model.dtype != torch.bfloat16:
        engine = Engine(load_model("gemma3-270m", dtype="bfloat16"), prefill_chunk=512)
    with_kernel = prefill(engine)
    assert calls and set(calls) == {None, engine.model.config.sliding_window}
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(chunk_attention, "available", lambda variant=None: False)
        with_sdpa = prefill(engine)
    assert calls == []
    assert with_kernel.argmax() == with_sdpa.argmax()
    assert (with_kernel - with_sdpa).abs().max() <= 0.05 * with_sdpa.abs().max()
    prefill(gemma_fp32_engine)  # head dim 256 fits the kernel; float32 does not
    assert calls == []


@needs_kernels
def test_loading_the_kernels_leaves_float32_denormals_alone():
    """A library built with -ffast-math and linked with it would turn on flush-to-zero for the
    whole process as it loads (gcc before 13): every torch operator's float32 denormals would
    become 0. cpu_kernels/build.py links without it. A fresh process, so the load happens here."""
    script = (
        "import torch\n"
        "from kvsnap.cpu_kernels import chunk_attention, decode_attention\n"
        "assert decode_attention.available()\n"
        "chunk_attention.available()\n"
        "print((torch.tensor([1e-40]) * 1.0).item())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) > 0
    assert "-shared" not in build.FLAGS
