"""A decode step's one-token attention over bf16 keys and values, in C (CPU).

``engine/batch.py``'s :func:`~.batch.one_token_attention` converts each row's bf16 keys and
values to float32 and then multiplies: the copies and the second read made it most of a
decode step with 8 sessions on 2K-row caches (docs/BENCHMARKS.md, "The decode step"). The C
function here reads each key and value once, widens it in registers (AVX-512 where the CPU
has it, plain C the compiler vectorizes elsewhere) and accumulates in float32, as that
function and SDPA do, so its output is theirs up to float32 rounding order. One call runs
every one-token row of a layer.

Work is split into units of one row, one KV head and one block of :data:`BLOCK` keys, spread
over torch's own OpenMP threads (the library links ``libgomp.so.1``, which resolves to the
copy torch already loaded, so the model thread's team runs it: no second thread pool). A
head's blocks are joined in their order, so a row's result depends neither on the rows that
share the call nor on the thread count (tests/engine/test_one_token_attention.py).

C source: ``cpu_kernels/csrc/decode_attention.c`` (every variant: AVX-512 where the variant has it,
plain C in ``generic``). Where no variant runs (:func:`available` False) the torch path runs.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

MAX_GROUP = 16  # query heads per KV head (the C code's MAXG)
BLOCK = 256  # keys per unit of work (the C code's BLK)


_INT, _LONG, _PTR = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
_ROWS = [_INT, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT, _INT, ctypes.c_float, _PTR, _INT]
_APPEND = [_INT] * 3 + [_PTR, _LONG, _LONG] * 2 + [_PTR] * 5


def _rows():
    return build.function("one_token_rows", _INT, _ROWS)


def _append():
    return build.function("append_rows", None, _APPEND)


def available() -> bool:
    """Whether the variant this process runs has the kernel (every variant does)."""
    return _rows() is not None


def takes(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes this row: bf16 on a CPU, at most :data:`MAX_GROUP` query heads a
    KV head, rows of contiguous values."""
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == keys.dtype == values.dtype == torch.bfloat16
        and query.shape[1] // keys.shape[1] <= MAX_GROUP
        and all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == dim for t in (keys, values))
    )


def one_token_rows(queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """Attention of one token per row over all its rows (no mask): queries ``[1, H, 1, D]``,
    keys / values ``[1, H_kv, L, D]`` (each :func:`takes`) -> per row ``[1, 1, H, D]`` bf16."""
    heads, dim = queries[0].shape[1], queries[0].shape[-1]
    q = torch.cat([x.reshape(heads, dim) for x in queries])  # [R * H, D]
    pairs = zip(keys, values, strict=True)
    rows = [(k.data_ptr(), v.data_ptr(), k.shape[-2], k.stride(1), v.stride(1)) for k, v in pairs]
    out = attend(q, rows, keys[0].shape[1], scale)
    return list(out.view(len(queries), 1, 1, heads, dim).unbind(0))


def attend(queries: torch.Tensor, rows: list[tuple], kv_heads: int, scale: float) -> torch.Tensor:
    """The kernel on raw rows: ``queries`` ``[R * H, D]`` (R rows of H heads); per row its keys'
    and values' addresses, length and head strides (elements), bf16 rows of D contiguous
    values. Returns ``[R * H, D]`` bf16."""
    heads_total, dim = queries.shape
    n = len(rows)
    q = queries.float().contiguous()
    out = torch.empty(heads_total, dim)
    ptrs = ctypes.c_void_p * n
    longs = ctypes.c_long * n
    k_ptr, v_ptr, lengths, k_strides, v_strides = zip(*rows, strict=True)
    build.run_on_team(
        _rows(),
        n,
        q.data_ptr(),
        ptrs(*k_ptr),
        ptrs(*v_ptr),
        longs(*lengths),
        longs(*k_strides),
        longs(*v_strides),
        heads_total // n,
        kv_heads,
        dim,
        scale,
        out.data_ptr(),
        what="the attention kernel",
    )
    return out.to(torch.bfloat16)


def append_rows(*args) -> None:
    """The C ``append_rows`` (cpu_kernels/decode_rows.py's one call a layer)."""
    _append()(*args)
