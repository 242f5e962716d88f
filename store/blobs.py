"""A session's KV at rest: a :class:`KVBlob` (each layer's keys and values, the session's
logical length, the version it belongs to, a checksum, KIVI-packed or not) and its bytes
(safetensors with the metadata in the header) on disk and in a drain's hand-over."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import load, save

from kvsnap.policies.kivi import KIVI, unpack


@dataclass(slots=True)
class KVBlob:
    """One session's KV at rest: ``[k_0, v_0, k_1, v_1, ...]`` plus the lengths to rebuild the cache.

    A KIVI-packed blob has ``layout`` (one entry per original tensor) and its ``tensors`` are
    the packed parts; :meth:`unpacked` gives the dequantized tensors back. An ``exact`` blob is
    never quantized, whatever the tier's KIVI settings (a re-selection session's full copy: its
    rows are scored and copied back every turn, so they stay at full precision).

    A mixed-precision session's quantized rows (engine/cold.py) travel as ``cold``: its parts
    and their layout, as they are on the device (a tier's KIVI settings never touch them)."""

    tensors: list[torch.Tensor]
    logical_len: int
    version: int  # the directory version this KV belongs to
    checksum: str = ""
    layout: list[dict] | None = None
    exact: bool = False
    cold: tuple[list[torch.Tensor], list[dict]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._all())

    def _all(self) -> list[torch.Tensor]:
        return self.tensors if self.cold is None else [*self.tensors, *self.cold[0]]

    def compute_checksum(self) -> str:
        """CRC-32 of the lengths, the layout and every tensor's shape and bytes (read in place):
        what the host and disk tiers and a hand-over check. It catches corruption, not tampering;
        blake2b took 71 ms for a 46 MiB session, on every demotion and every load from the host
        tier, and CRC-32 takes 14 ms (docs/BENCHMARKS.md, "Tiered session store")."""
        header = f"{self.logical_len}:{self.version}"
        if self.layout is not None:
            header += json.dumps(self.layout, sort_keys=True)
        if self.cold is not None:
            header += json.dumps(self.cold[1], sort_keys=True)
        crc = zlib.crc32(header.encode())
        for t in self._all():
            crc = zlib.crc32(str(tuple(t.shape)).encode(), crc)
            crc = zlib.crc32(memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()), crc)
        return f"crc32:{crc:08x}"

    def to(self, device: torch.device | str, pin: bool = False) -> KVBlob:
        def move(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            moved = [t.to(device) for t in tensors]
            return [t.pin_memory() for t in moved] if pin else moved

        cold = None if self.cold is None else (move(self.cold[0]), self.cold[1])
        return KVBlob(move(self.tensors), self.logical_len, self.version, self.checksum, self.layout, self.exact, cold)

    def packed(self, kivi: KIVI) -> KVBlob:
        parts, layout = kivi.pack(self.tensors)
        return KVBlob(parts, self.logical_len, self.version, "", layout, cold=self.cold)

    def unpacked(self) -> KVBlob:
        if self.layout is None:
            return self
        return KVBlob(unpack(self.tensors, self.layout), self.logical_len, self.version, cold=self.cold)

    def packed_by(self, kivi: KIVI | None) -> bool:
        """True when this blob is stored exactly as ``kivi`` (None: unquantized) would store it."""
        if self.layout is None or kivi is None:
            return self.layout is None and kivi is None
        want = kivi.settings()
        return all({k: m[k] for k in want} == want for m in self.layout)


def blob_to_bytes(blob: KVBlob) -> bytes:
    """A self-checking serialisation (safetensors + checksum in its metadata): disk tier and hand-over."""
    tensors = {f"t{i}": t.detach().contiguous().cpu() for i, t in enumerate(blob.tensors)}
    if blob.cold is not None:
        tensors |= {f"c{i}": t.detach().contiguous().cpu() for i, t in enumerate(blob.cold[0])}
    meta = {
        "logical_len": str(blob.logical_len),
        "version": str(blob.version),
        "n": str(len(blob.tensors)),
        "checksum": blob.compute_checksum(),
    }
    if blob.layout is not None:
        meta["layout"] = json.dumps(blob.layout)
    if blob.exact:
        meta["exact"] = "1"
    if blob.cold is not None:
        meta["cold"] = json.dumps({"n": len(blob.cold[0]), "layout": blob.cold[1]})
    return save(tensors, metadata=meta)


def blob_from_bytes(data: bytes) -> KVBlob:
    """Inverse of :func:`blob_to_bytes`; raises ValueError on a truncated, garbled or mismatching blob."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
        loaded = load(data)
        cold = json.loads(meta["cold"]) if "cold" in meta else None
        blob = KVBlob(
            [loaded[f"t{i}"] for i in range(int(meta["n"]))],
            int(meta["logical_len"]),
            int(meta["version"]),
            meta["checksum"],
            json.loads(meta["layout"]) if "layout" in meta else None,
            meta.get("exact") == "1",
            None if cold is None else ([loaded[f"c{i}"] for i in range(cold["n"])], cold["layout"]),
        )
    except Exception as exc:
        raise ValueError(f"unreadable KV blob: {exc}") from exc
    if blob.compute_checksum() != blob.checksum:
        raise ValueError("KV blob checksum mismatch")
    return blob
