"""A prompt chunk's attention over bf16 keys and values, in C: on AMX tiles (Intel CPUs with AMX)
or in AVX-512 BF16 vector registers (CPUs with ``avx512_bf16`` and no tiles, such as AMD's Zen 4).

torch's CPU SDPA ran a 2K bf16 prefill's second chunk at 200-360 GFLOP/s on this project's Intel
machine (two cores with AMX), where matrix products on the same cores reach about 420, and
attention was still about 40 % of SmolLM2's prefill and much of a later chat's first token on a
shared document (docs/BENCHMARKS.md, "A prompt chunk's attention on AMX tiles"). On a Zen 4
machine without tiles it was about 40 % of the prefill too ("... in AVX-512 BF16").

The function is flash attention (engine/chunk_source.py): for one query head and 16 of the
chunk's queries (a unit of work), it walks the session's rows in blocks of 256 keys, multiplies
queries by keys (bf16 products summed in float32), keeps a running softmax in float32 (each
row's largest score and sum, updated once a block; scores go to base 2 with the scale in one
product), rounds the block's weights to bf16 and multiplies them by the values again, as
torch's CPU flash kernel does (its weights go to bf16 for that product too). The mask is
implicit: query ``i`` of a chunk of ``T`` over ``L`` rows is row ``L - T + i`` and sees the rows
at or before it, within ``window`` of it on a sliding layer (:func:`.batch.mask`'s rule); blocks
nobody in a unit can see are skipped.

Units run on torch's own OpenMP threads (see engine/kernels.py). A query's result is computed
by one unit, over its rows in order: it depends neither on the other rows of the step nor on
the thread count. The two builds sum in other orders, so their bits differ within float32
rounding.

The source is compiled on first use (engine/cbuild.py): the tile build where the CPU has AMX
(``amx_bf16`` in its flags) and the process gets the kernel's permission for the tiles' state,
else the vector build where it has ``avx512_bf16``; elsewhere, or with ``KVSNAP_C_KERNELS=0``,
:func:`kernel` is None and SDPA runs (engine/batch.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import cbuild
from .chunk_source import SOURCE

log = logging.getLogger(__name__)

MAX_DIM = 256  # head dims up to this, in multiples of 32 (the C code's MAXD)
BUILDS = {"tiles": "amx_bf16", "vectors": "avx512_bf16"}  # a build and the CPU flag it needs


@functools.cache
def library(build: str) -> ctypes.CDLL | None:
    """One build of the kernel (``tiles`` or ``vectors``), or None: the CPU lacks its flag, the
    process got no permission for the tiles' state, or it did not compile (engine/cbuild.py)."""
    if BUILDS[build] not in cbuild.cpu_flags().split():
        return None
    lib = cbuild.build(f"chunk_{build}", f"#define TILES {int(build == 'tiles')}\n{SOURCE}")
    if lib is None:
        return None
    if lib.chunk_init() != 0:
        log.warning("Linux refused the AMX tile state: a prompt chunk's attention takes another path")
        return None
    fn = lib.chunk_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    fn.argtypes += [ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def builds() -> list[str]:
    """The builds this machine runs, the one :func:`kernel` takes first."""
    return [build for build in BUILDS if library(build) is not None]


@functools.cache
def build() -> str | None:
    """The build a bf16 chunk takes here: tiles where the CPU has them, else vectors, else None."""
    return next(iter(builds()), None)


def kernel() -> ctypes.CDLL | None:
    """The library of :func:`build`, or None (SDPA runs)."""
    chosen = build()
    return library(chosen) if chosen else None


def fits(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
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
    build: str = "",
    shared=None,
):
    """A chunk's attention: query ``[1, H, T, D]``, the session's rows ``[1, H_kv, L, D]`` (the chunk's
    own last), causal and within ``window`` rows (None: no window) -> ``[1, T, H, D]`` bf16. ``build``:
    one of :data:`BUILDS` (tests, benchmarks); by default :func:`kernel`'s. ``shared``: rows before
    ``keys`` / ``values`` that a shared prefix's blocks hold (engine/prefix_rows.py ``SharedRows``)."""
    _, heads, count, dim = query.shape
    kv_heads, rows = keys.shape[1], keys.shape[2]
    out = torch.empty(1, count, heads, dim, dtype=torch.bfloat16)
    paged = (None, None, 0, 1)  # no shared rows: every row at keys / values
    if shared is not None:  # per block, its keys' and its values' address
        paged = (shared.keys.data_ptr(), shared.values.data_ptr(), shared.rows, shared.block)
    failed = (library(build) if build else kernel()).chunk_attention(
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
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the chunk attention kernel could not allocate its work space")
    return out
