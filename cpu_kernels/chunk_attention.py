"""A prompt chunk's attention over bf16 keys and values, in C: on AMX tiles (Intel CPUs with AMX)
or in AVX-512 BF16 vector registers (CPUs with ``avx512_bf16`` and no tiles, such as AMD's Zen 4).

torch's CPU SDPA ran a 2K bf16 prefill's second chunk at 200-360 GFLOP/s on this project's Intel
machine (two cores with AMX), where matrix products on the same cores reach about 420, and
attention was still about 40 % of SmolLM2's prefill and much of a later chat's first token on a
shared document (docs/BENCHMARKS.md, "A prompt chunk's attention on AMX tiles"). On a Zen 4
machine without tiles it was about 40 % of the prefill too ("... in AVX-512 BF16").

The function is flash attention (cpu_kernels/csrc/chunk_blocks.h, chunk_attention.c): for one query head and 16 of the
chunk's queries (a unit of work), it walks the session's rows in blocks of 256 keys, multiplies
queries by keys (bf16 products summed in float32), keeps a running softmax in float32 (each
row's largest score and sum, updated once a block; scores go to base 2 with the scale in one
product), rounds the block's weights to bf16 and multiplies them by the values again, as
torch's CPU flash kernel does (its weights go to bf16 for that product too). The mask is
implicit: query ``i`` of a chunk of ``T`` over ``L`` rows is row ``L - T + i`` and sees the rows
at or before it, within ``window`` of it on a sliding layer (:func:`.batch.mask`'s rule); blocks
nobody in a unit can see are skipped.

Units run on torch's own OpenMP threads (see cpu_kernels/build.py). A query's result is computed
by one unit, over its rows in order: it depends neither on the other rows of the step nor on
the thread count. The two builds sum in other orders, so their bits differ within float32
rounding.

The ``amx`` variant (cpu_kernels/build.py) has the tile build, ``avx512bf16`` the vector build,
``generic`` neither: there :func:`available` is False and SDPA runs (engine/batch.py).
"""

from __future__ import annotations

import ctypes

import torch

from . import build

MAX_DIM = 256  # head dims up to this, in multiples of 32 (the C code's MAXD)
_INT, _LONG, _PTR = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
_ARGS = [_PTR, _LONG, _LONG, _PTR, _LONG, _PTR, _LONG, _PTR, _PTR, _LONG, _LONG, _LONG, _LONG]
_ARGS += [_INT, _INT, _INT, _INT, ctypes.c_float, _PTR, _INT]


def _fn(variant: str | None = None):
    return build.function("chunk_attention", _INT, _ARGS, variant)


def available(variant: str | None = None) -> bool:
    """Whether ``variant`` (default: the one this process runs) has the kernel: amx, avx512bf16."""
    return _fn(variant) is not None


def variants() -> list[str]:
    """The variants this process runs that have the kernel (tests and benchmarks compare them)."""
    return [v for v in build.runnable() if available(v)]


def takes(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes this row: bf16 on a CPU, a head dim that is a multiple of 32 up
    to :data:`MAX_DIM`, whole query heads a KV head, rows of contiguous dims."""
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype == torch.bfloat16
        and dim % 32 == 0
        and dim <= MAX_DIM
        and query.shape[1] % keys.shape[1] == 0
        and query.shape[0] == 1
        and query.stride(-1) == 1
        and all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == dim for t in (keys, values))
    )


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None,
    variant: str | None = None,
    shared=None,
):
    """A chunk's attention: query ``[1, H, T, D]``, the session's rows ``[1, H_kv, L, D]`` (the chunk's
    own last), causal and within ``window`` rows (None: no window) -> ``[1, T, H, D]`` bf16. ``variant``:
    a kernel variant (tests, benchmarks); by default the one this process runs. ``shared``: rows before
    ``keys`` / ``values`` that a shared prefix's blocks hold (engine/prefix_rows.py ``SharedRows``)."""
    _, heads, count, dim = query.shape
    kv_heads, rows = keys.shape[1], keys.shape[2]
    out = torch.empty(1, count, heads, dim, dtype=torch.bfloat16)
    paged = (None, None, 0, 1)  # no shared rows: every row at keys / values
    if shared is not None:  # per block, its keys' and its values' address
        paged = (shared.keys.data_ptr(), shared.values.data_ptr(), shared.rows, shared.block)
    build.run_on_team(
        _fn(variant),
        query.data_ptr(),
        query.stride(1),
        query.stride(2),
        keys.data_ptr(),
        keys.stride(1),
        values.data_ptr(),
        values.stride(1),
        *paged,
        count,
        rows + (0 if shared is None else shared.rows),
        heads,
        kv_heads,
        dim,
        window or 0,
        scale,
        out.data_ptr(),
        what="the chunk attention kernel",
    )
    return out
