"""Mixed precision: the rows a selection leaves out, kept KIVI-quantized instead of dropped.

A policy whose ``rest`` is ``kivi4`` or ``kivi2`` (policies/base.py) still selects rows as it
would to evict: the rows it selects (the window, sinks and spans among them) stay in the
layer's buffer at the cache's precision, and every other row goes to the layer's
:class:`ColdRows` at 4 or 2 bits (KIVI groups of :data:`GROUP`: keys per channel, values per
token; policies/kivi.py), where every later query of the layer still reads it.

Cold rows are all older than any row still to come, so every new token sees them: their
order does not matter to attention, and a layer attends over ``[cold rows, kept rows, new
rows]`` (engine/cache.py ``CompressedLayer.update``). Each compression adds one segment (the
rows it leaves out of the kept ones); cold rows are never selected again. Rows of a segment
that do not fill a key group stay at the cache's precision inside it (counted as cold: they
are never selected again either).

Attention dequantizes the cold rows of a layer when it reads them (torch; no copy is kept),
so a session's bytes on the device are its bytes at rest: :meth:`ColdRows.nbytes` counts the
codes, scales, zero points and unquantized rows it holds.
"""

from __future__ import annotations

import torch

from kvsnap.policies import gather_rows
from kvsnap.policies.kivi import KIVI, dequantize

GROUP = 32  # tokens a key group spans, channels a value group spans


def rest_kivi(policy) -> KIVI | None:
    """The quantizer for the rows ``policy``'s selection leaves out; None: they are dropped."""
    rest = getattr(policy, "rest", "drop")
    return None if rest == "drop" else KIVI(bits=int(rest[-1]), group=GROUP, residual=0)


class ColdRows:
    """One layer's quantized rows: segments of (key parts, key meta, value parts, value meta),
    each as :meth:`KIVI.quantize` makes them."""

    __slots__ = ("segments", "kernel_view")

    def __init__(self, segments: list[tuple] | None = None):
        self.segments = segments or []
        self.kernel_view = None  # what the decode kernel reads (cpu_kernels/cold_attention.py), made once

    @property
    def rows(self) -> int:
        return sum(meta["shape"][2] for _, meta, _, _ in self.segments)

    def add(self, kivi: KIVI, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``[1, H_kv, n, D]`` rows and hold them."""
        k_parts, k_meta = kivi.quantize(keys, "channel")
        v_parts, v_meta = kivi.quantize(values, "token")
        self.segments.append((k_parts, k_meta, v_parts, v_meta))
        self.kernel_view = None

    def add_left_out(self, kivi: KIVI, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Hold the rows of ``keys`` / ``values`` ``[1, H_kv, L, D]`` that ``positions``
        (``[1, H_kv, k]``, the kept ones) leaves out, per head, in order."""
        batch, heads, length, _ = keys.shape
        left = torch.ones(batch, heads, length, dtype=torch.bool, device=positions.device)
        left.scatter_(-1, positions, False)
        rest = left.nonzero()[:, -1].view(batch, heads, length - positions.shape[-1])
        if rest.shape[-1]:
            rest = rest.to(keys.device)
            self.add(kivi, gather_rows(keys, rest).contiguous(), gather_rows(values, rest).contiguous())

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cold row at the cache's precision: keys, values ``[1, H_kv, rows, D]``."""
        keys = [dequantize(k_parts, k_meta) for k_parts, k_meta, _, _ in self.segments]
        values = [dequantize(v_parts, v_meta) for _, _, v_parts, v_meta in self.segments]
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def before(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cold row dequantized, then ``keys`` / ``values``: the rows attention reads (torch)."""
        cold_keys, cold_values = self.dequantized()
        return torch.cat([cold_keys, keys], dim=-2), torch.cat([cold_values, values], dim=-2)

    def nbytes(self) -> int:
        parts = [t for k, _, v, _ in self.segments for t in (*k, *v)]
        return sum(t.numel() * t.element_size() for t in parts)

    # -- at rest ---------------------------------------------------------------------------
    def export(self) -> tuple[list[torch.Tensor], list[dict]]:
        """(flat parts, one entry per segment naming its key and value metas and part counts)."""
        parts, layout = [], []
        for k_parts, k_meta, v_parts, v_meta in self.segments:
            parts += [*k_parts, *v_parts]
            layout.append({"keys": k_meta | {"parts": len(k_parts)}, "values": v_meta | {"parts": len(v_parts)}})
        return parts, layout

    @classmethod
    def load(cls, parts: list[torch.Tensor], layout: list[dict]) -> ColdRows:
        """Inverse of :meth:`export`; ValueError when the parts do not match the layout."""
        segments, at = [], 0
        for entry in layout:
            nk, nv = entry["keys"]["parts"], entry["values"]["parts"]
            if at + nk + nv > len(parts):
                raise ValueError(f"cold rows' layout names more parts than the {len(parts)} given")
            segments.append((parts[at : at + nk], entry["keys"], parts[at + nk : at + nk + nv], entry["values"]))
            at += nk + nv
        if at != len(parts):
            raise ValueError(f"cold rows' layout names {at} parts, {len(parts)} were given")
        return cls(segments)


def export_cold(cache) -> tuple[list[torch.Tensor], list[dict]] | None:
    """Every layer's cold rows: (flat parts, ``[{"layer": i, "segments": [...]}, ...]``); None
    when no layer holds any (what a tier blob's ``cold`` takes)."""
    parts, layout = [], []
    for i, layer in enumerate(cache.layers):
        cold = getattr(layer, "cold", None)
        if cold is not None:
            layer_parts, segments = cold.export()
            parts += layer_parts
            layout.append({"layer": i, "segments": segments, "parts": len(layer_parts)})
    return (parts, layout) if layout else None


def fill_cold(cache, parts: list[torch.Tensor], layout: list[dict]) -> None:
    """Give a filled session cache the cold rows :func:`export_cold` exported."""
    at = 0
    for entry in layout:
        layer = cache.layers[entry["layer"]]
        if not hasattr(layer, "cold"):
            raise ValueError(f"layer {entry['layer']} holds no cold rows (a sliding-window layer)")
        n = entry["parts"]
        layer.cold = ColdRows.load(parts[at : at + n], entry["segments"])
        at += n
    if at != len(parts):
        raise ValueError(f"the cold layout names {at} parts, {len(parts)} were given")
