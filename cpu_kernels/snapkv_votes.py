"""SnapKV's votes over bf16 keys, in C: the observation window's attention over a layer's rows,
summed over the window's queries, without the float32 copies and the ``[H, w, L]`` attention
torch's path (``policies/base.py`` ``window_attention``) makes.

A prompt's compression scores every row of every full-attention layer with the queries of its
last ``w`` tokens: for each query head, each window query's softmax over the rows it sees,
summed over the window (SnapKV's votes, before pooling). In torch that is a float32 copy of the
keys, a float32 product and a softmax over ``[H, w, L]``; on SmolLM2's 30 layers and a 2.4K-token
prompt it was ~75 ms of a later chat's compression here, most of the compression. This is the
same sum in one pass per (query head, 16 window queries): the scores by the prompt-chunk
kernel's products (cpu_kernels/csrc/chunk_blocks.h: bf16 pairs summed in float32, AMX tiles or AVX-512
BF16 vectors), each query's softmax in float32 (to base 2, as that kernel's), added to the
head's votes for the rows before the window. The products of bf16 values are exact in float32
either way; the sums run in another order than torch's, so votes differ from its within float32
rounding (tests/cpu_kernels/test_snapkv_votes.py), and a selection can differ only where two rows' scores
tie to that rounding.

Units run on torch's own OpenMP threads (cpu_kernels/build.py); each unit writes its own votes,
joined in a fixed order after, so the result depends neither on the thread count nor on timing.
C source: cpu_kernels/csrc/snapkv_votes.c, in the variants that have the prompt-chunk kernel (amx,
avx512bf16); elsewhere :func:`takes` says no and torch's path runs.
"""

from __future__ import annotations

import ctypes

import torch

from . import build, chunk_attention

_INT, _LONG, _PTR = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
_ARGS = [_PTR, _LONG, _LONG, _PTR, _LONG, _PTR, _LONG, _LONG, _LONG, _INT, _INT, _INT, _INT, ctypes.c_float, _PTR, _INT]


def _fn():
    return build.function("window_votes", _INT, _ARGS)


def available() -> bool:
    return _fn() is not None


def takes(window_queries: torch.Tensor, keys: torch.Tensor, shared: int = 0) -> bool:
    """Whether :func:`votes` takes these: bf16 on a CPU, one sequence, the chunk kernel's head dims,
    whole query heads a KV head, rows of contiguous dims, a window shorter than the rows (with
    ``shared`` rows before ``keys``)."""
    return (
        chunk_attention.takes(window_queries, keys, keys)
        and keys.shape[2] + shared > window_queries.shape[2]
        and available()
    )


def votes(window_queries: torch.Tensor, keys: torch.Tensor, scale: float, shared=None) -> torch.Tensor:
    """SnapKV's votes: ``[1, H, w, D]`` window queries over ``[1, H_kv, L, D]`` rows (the window
    the last ``w``) -> ``[1, H_kv, G, L - w]`` float32, each window query's causal softmax summed
    over the window, for the rows before it (:func:`takes` them). ``shared``: rows before ``keys``
    that a shared prefix's blocks hold (engine/prefix_rows.py ``SharedRows``), counted in L."""
    _, heads, w, dim = window_queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    paged = (None, 0, 1)  # no shared rows: every row at keys
    if shared is not None:
        paged, length = (shared.keys.data_ptr(), shared.rows, shared.block), length + shared.rows
    out = torch.empty(heads, length - w, dtype=torch.float32)
    build.run_on_team(
        _fn(),
        window_queries.data_ptr(),
        window_queries.stride(1),
        window_queries.stride(2),
        keys.data_ptr(),
        keys.stride(1),
        *paged,
        length,
        heads,
        kv_heads,
        dim,
        w,
        scale,
        out.data_ptr(),
        what="the votes kernel",
    )
    return out.view(1, kv_heads, heads // kv_heads, length - w)
