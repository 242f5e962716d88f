"""A packed step's one-token rows without torch operators per row and layer (bf16 on a CPU).

A decode step of R sessions used to cost, at every layer and for every row, the slices and
copies that append its new key and value (engine/cache.py) and the views, reshapes and
concatenations that hand its rows to the attention kernel (cpu_kernels/decode_attention.py): a few dozen
operator calls per row and layer, about 10 ms of a 44 ms step of 8 SmolLM2 sessions, more
than the attention itself. Here the rows that take the C kernel anyway (one token, no capture
at this layer) are appended by one C call per layer (``append_rows``: plain copies of the
projection's bits), and their attention is one call on the rows' addresses: each row costs a
few Python attribute reads, not operators. The results are the same bits as the operator path
(tests/cpu_kernels/test_decode_rows.py): the same copies, the same kernel on the same rows.
"""

from __future__ import annotations

import ctypes

import torch

from . import decode_attention

BF16 = 2  # bytes of an element


class OneTokenRows:
    """One layer's fast rows after their append: which rows of the step (``index``), and per row
    the keys' and values' buffers and the span ``[start, end)`` of rows its token sees."""

    __slots__ = ("index", "buffers", "spans")

    def __init__(self):
        self.index: list[int] = []
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.spans: list[tuple[int, int]] = []

    @property
    def kv_heads(self) -> int:
        return self.buffers[0][0].shape[1]

    def views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``i``'s keys and values as ``[1, H_kv, rows, D]`` views (what the operator path
        hands an attention function)."""
        (k, v), (start, end) = self.buffers[i], self.spans[i]
        return k[:, :, start:end], v[:, :, start:end]

    def attend(self, query: torch.Tensor, columns: list[int], scale: float) -> torch.Tensor:
        """The kernel over these rows: ``query`` ``[1, H, T, D]``, row ``i``'s token at packed
        position ``columns[i]``; returns ``[R, H, D]`` bf16."""
        _, heads, total, dim = query.shape
        q = query[0] if columns == list(range(total)) else query[0, :, columns]  # [H, R, D]
        q = q.transpose(0, 1)
        rows = []
        for (k, v), (start, end) in zip(self.buffers, self.spans, strict=True):
            first = start * dim * BF16  # bytes into a head's rows
            rows.append((k.data_ptr() + first, v.data_ptr() + first, end - start, k.stride(1), v.stride(1)))
        out = decode_attention.attend(q.reshape(len(columns) * heads, dim), rows, self.kv_heads, scale)
        return out.view(len(columns), heads, dim)


def takes(key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """Whether this step's keys and values can take the fast path: bf16 on a CPU, the kernel
    built, rows of contiguous values."""
    return (
        key_states.device.type == "cpu"
        and key_states.dtype == value_states.dtype == torch.bfloat16
        and key_states.stride(-1) == value_states.stride(-1) == 1
        and decode_attention.available()
    )


def append(
    index: list[int], layers: list, columns: list[int], key_states: torch.Tensor, value_states: torch.Tensor
) -> OneTokenRows:
    """Append the step's rows ``index``, each one new key and value (``key_states[:, :,
    columns[i]]``), to their cache layers ``layers[i]`` (every one initialized): one C call."""
    rows = OneTokenRows()
    rows.index = index
    dim = key_states.shape[-1]
    k_dst, v_dst, k_strides, v_strides = [], [], [], []
    for layer in layers:
        k, v, row, start = layer.claim(key_states, value_states)
        rows.buffers.append((k, v))
        rows.spans.append((start, row + 1))
        k_strides.append(k.stride(1))
        v_strides.append(v.stride(1))
        k_dst.append(k.data_ptr() + row * dim * BF16)
        v_dst.append(v.data_ptr() + row * dim * BF16)
    n, kv_heads = len(layers), key_states.shape[1]
    ptrs, longs = ctypes.c_void_p * n, ctypes.c_long * n
    decode_attention.append_rows(
        n,
        kv_heads,
        dim,
        key_states.data_ptr(),
        key_states.stride(1),
        key_states.stride(2),
        value_states.data_ptr(),
        value_states.stride(1),
        value_states.stride(2),
        longs(*columns),
        ptrs(*k_dst),
        ptrs(*v_dst),
        longs(*k_strides),
        longs(*v_strides),
    )
    return rows
