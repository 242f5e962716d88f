"""KIVI (Liu et al., 2024, arXiv 2402.02750): tuning-free asymmetric 2/4-bit KV quantization.

Keys are quantized per channel (a scale and zero point per channel for each group of
``group`` tokens: key outliers live in a few channels), values per token (a scale and zero
point per token for each group of ``group`` channels). The most recent ``residual`` rows,
and rows before them that do not fill a token group, stay in full precision.

Codes are packed (two 4-bit or four 2-bit codes a byte); scales and zero points are float16,
rounded so that every value stays inside its group's grid: the round-trip error of a value
is at most half its group's (stored) scale. A tensor whose range does not fit float16 is kept
in full precision.

Pure torch, no I/O: the tiers (``store/tiers.py``) use :meth:`KIVI.pack` / :func:`unpack` on
a session's tensors when they are configured to store quantized KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsnap.errors import InvalidArgument

from .base import _check_int

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


@dataclass(frozen=True, slots=True)
class KIVI:
    name = "kivi"

    bits: int = 2  # 2 or 4
    group: int = 32  # tokens per key group, channels per value group
    residual: int = 32  # most recent rows kept in full precision

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise InvalidArgument(f"KIVI bits must be 2 or 4, got {self.bits!r}")
        _check_int("group", self.group, minimum=1)
        _check_int("residual", self.residual, minimum=0)

    def settings(self) -> dict:
        return {"bits": self.bits, "group_size": self.group, "residual": self.residual}

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    # -- one tensor ------------------------------------------------------------------------
    def quantized_rows(self, rows: int) -> int:
        """Rows quantized out of ``rows``: whole token groups before the residual."""
        return max(0, rows - self.residual) // self.group * self.group

    def quantize(self, x: torch.Tensor, per: str) -> tuple[list[torch.Tensor], dict]:
        """x: [B, H, L, D] -> (parts, meta). ``per``: "channel" (keys) or "token" (values)."""
        if per not in ("channel", "token"):
            raise InvalidArgument(f"per must be 'channel' or 'token', got {per!r}")
        batch, heads, rows, dim = x.shape
        meta = {"shape": [batch, heads, rows, dim], "dtype": str(x.dtype), "per": per} | self.settings()
        q_rows = self.quantized_rows(rows)
        if q_rows == 0:
            return [x], meta | {"kind": "raw"}
        body = x[:, :, :q_rows].float()
        if per == "channel":  # groups of `group` tokens, per channel: [B, H, L_q / G, G, D]
            grouped, axis, gsize = body.reshape(batch, heads, q_rows // self.group, self.group, dim), 3, self.group
        else:  # per token, groups of `group` channels (all channels when they do not split evenly)
            gsize = self.group if dim % self.group == 0 else dim
            grouped, axis = body.reshape(batch, heads, q_rows, dim // gsize, gsize), 4
        zero, scale = _grid(grouped.amin(dim=axis, keepdim=True), grouped.amax(dim=axis, keepdim=True), self.levels)
        if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
            return [x], meta | {"kind": "raw"}
        codes = ((grouped - zero.float()) / scale.float().clamp_min(1e-30)).round().clamp_(0, self.levels)
        packed = pack_codes(codes.to(torch.uint8).flatten(), self.bits)
        residual = x[:, :, q_rows:].contiguous()
        return [packed, scale, zero, residual], meta | {"kind": "kivi", "rows": q_rows, "group": gsize}

    # -- a session's tensors ---------------------------------------------------------------
    def pack(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
        """``[k_0, v_0, k_1, v_1, ...]`` -> (flat parts, one meta per tensor)."""
        parts, layout = [], []
        for i, t in enumerate(tensors):
            p, meta = self.quantize(t, "channel" if i % 2 == 0 else "token")
            parts += p
            layout.append(meta | {"parts": len(p)})
        return parts, layout


def unpack(parts: list[torch.Tensor], layout: list[dict]) -> list[torch.Tensor]:
    """Inverse of :meth:`KIVI.pack` (dequantized, in each tensor's original dtype)."""
    out, at = [], 0
    for meta in layout:
        n = meta["parts"]
        out.append(dequantize(parts[at : at + n], meta))
        at += n
    if at != len(parts):
        raise ValueError(f"KIVI layout names {at} parts, the blob has {len(parts)}")
    return out


def dequantize(parts: list[torch.Tensor], meta: dict) -> torch.Tensor:
    if meta["kind"] == "raw":
        return parts[0]
    packed, scale, zero, residual = parts
    batch, heads, rows, dim = meta["shape"]
    q_rows, gsize = meta["rows"], meta["group"]
    if meta["per"] == "channel":
        grouped_shape = (batch, heads, q_rows // gsize, gsize, dim)
    else:
        grouped_shape = (batch, heads, q_rows, dim // gsize, gsize)
    count = batch * heads * q_rows * dim
    codes = unpack_codes(packed, meta["bits"], count).view(grouped_shape).float()
    body = (codes * scale.float() + zero.float()).reshape(batch, heads, q_rows, dim)
    return torch.cat([body.to(_DTYPES[meta["dtype"]]), residual.to(body.device)], dim=2)


def _grid(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 zero point <= lo and scale with zero + levels * scale >= hi (so nothing clips)."""
    tiny = 2.0**-24  # float16's smallest step
    zero = lo.half()
    zero = torch.where(zero.float() > lo, (lo - lo.abs() * 2.0**-10 - tiny).half(), zero)
    span = (hi - zero.float()) / levels
    scale = span.half()
    scale = torch.where(scale.float() < span, (span * (1 + 2.0**-10) + tiny).half(), scale)
    return zero, scale


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits (flat) -> bytes holding 8 / bits codes each."""
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    codes = torch.cat([codes, codes.new_zeros(pad)]).view(-1, per_byte)
    out = torch.zeros(codes.shape[0], dtype=torch.uint8, device=codes.device)
    for j in range(per_byte):
        out |= codes[:, j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (bits * j)) & mask for j in range(per_byte)], dim=-1)
    return codes.flatten()[:count]


def parse_kivi(text: str, group: int = 32, residual: int = 32) -> KIVI | None:
    """``"none"`` -> None; ``"kivi2"`` / ``"kivi4"`` -> :class:`KIVI` with that many bits."""
    if text in ("", "none"):
        return None
    if text in ("kivi2", "kivi4"):
        return KIVI(bits=int(text[-1]), group=group, residual=residual)
    raise InvalidArgument(f"KV quantization must be none, kivi2 or kivi4, got {text!r}")
