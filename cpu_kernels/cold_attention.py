"""A decode step's one-token attention over a mixed-precision layer, in C (CPU): the layer's
KIVI-quantized rows (engine/cold.py) read where they lie, beside its bf16 rows.

Without it a decode step dequantizes every quantized row of a layer into a new bf16 tensor and
concatenates it before the kept rows (``CompressedLayer.update``): a copy of the whole layer
per step. The C function takes the quantized segments as they are, widens one block of rows at
a time into bf16 scratch exactly as ``policies/kivi.py``'s ``dequantize`` does, and runs the
one-token kernel's block code on it (cpu_kernels/csrc/decode_blocks.h), so its output is
:mod:`.decode_attention`'s over the dequantized rows, up to float32 rounding order.

C source: ``cpu_kernels/csrc/cold_attention.c``. Where no variant runs, the torch path runs.
"""

from __future__ import annotations

import ctypes

import torch

from . import build, decode_attention

_INT, _LONG, _PTR = ctypes.c_int, ctypes.c_long, ctypes.c_void_p


class Segment(ctypes.Structure):
    """One segment of quantized rows (the C ``cold_seg``)."""

    _fields_ = [
        ("kc", _PTR), ("ks", _PTR), ("kz", _PTR), ("vc", _PTR), ("vs", _PTR), ("vz", _PTR),
        ("rows", _LONG), ("rk", _PTR), ("rv", _PTR), ("res", _LONG), ("vg", _LONG), ("bits", _LONG),
    ]  # fmt: skip


_ROWS = [_INT, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT, _INT, ctypes.c_float, _PTR, _INT]


def _rows():
    return build.function("one_token_cold_rows", _INT, _ROWS)


def available() -> bool:
    return _rows() is not None


def segments(cold) -> list[Segment] | None:
    """The C view of a layer's :class:`~kvsnap.engine.cold.ColdRows` (made once: its segments
    never change), or None when the kernel cannot read them (not bf16, not in groups of 32
    rows with float16 scales, not contiguous)."""
    if cold.kernel_view is not None:
        return cold.kernel_view or None
    out = []
    for k_parts, k_meta, v_parts, v_meta in cold.segments:
        if k_meta["dtype"] != "torch.bfloat16" or k_meta["kind"] != v_meta["kind"]:
            out = []
            break
        if k_meta["kind"] == "raw":
            rk, rv = k_parts[0], v_parts[0]
            seg = Segment(rows=0, rk=rk.data_ptr(), rv=rv.data_ptr(), res=rk.shape[2], vg=1, bits=k_meta["bits"])
        else:
            (kc, ks, kz, rk), (vc, vs, vz, rv) = k_parts, v_parts
            contiguous = all(t.is_contiguous() for t in (*k_parts, *v_parts))
            if k_meta["group"] != 32 or ks.dtype != torch.float16 or not contiguous:
                out = []
                break
            seg = Segment(
                kc.data_ptr(), ks.data_ptr(), kz.data_ptr(), vc.data_ptr(), vs.data_ptr(), vz.data_ptr(),
                k_meta["rows"], rk.data_ptr(), rv.data_ptr(), rk.shape[2], v_meta["group"], k_meta["bits"],
            )  # fmt: skip
        out.append(seg)
    cold.kernel_view = out or ()
    return cold.kernel_view or None


def one_token_rows(queries, keys, values, colds, scale: float) -> list[torch.Tensor]:
    """:func:`.decode_attention.one_token_rows` for rows whose layers also hold quantized rows:
    ``colds`` each row's :func:`segments` -> per row ``[1, 1, H, D]`` bf16."""
    heads, dim = queries[0].shape[1], queries[0].shape[-1]
    kv_heads, n = keys[0].shape[1], len(queries)
    q = torch.cat([x.reshape(heads, dim) for x in queries]).float().contiguous()
    out = torch.empty(n * heads, dim)
    flat = [seg for segs in colds for seg in segs]
    ptrs, longs = ctypes.c_void_p * n, ctypes.c_long * n
    build.run_on_team(
        _rows(),
        n,
        q.data_ptr(),
        ptrs(*(k.data_ptr() for k in keys)),
        ptrs(*(v.data_ptr() for v in values)),
        longs(*(k.shape[-2] for k in keys)),
        longs(*(k.stride(1) for k in keys)),
        longs(*(v.stride(1) for v in values)),
        (ctypes.c_int * n)(*(len(segs) for segs in colds)),
        (Segment * max(1, len(flat)))(*flat),
        heads,
        kv_heads,
        dim,
        scale,
        out.data_ptr(),
        what="the attention kernel",
    )
    return list(out.to(torch.bfloat16).view(n, 1, 1, heads, dim).unbind(0))


def takes(query, keys, values) -> bool:
    """What :func:`.decode_attention.takes` asks of the bf16 rows, and rows of a multiple of 4
    values (whole bytes of 2-bit codes)."""
    return query.shape[-1] % 4 == 0 and decode_attention.takes(query, keys, values)
