"""Tiered session-KV store: device -> host -> disk, each with a byte budget.

A session's compressed KV (a :class:`KVBlob`) lives in exactly one tier. When a
tier is over budget its least recently used blobs are demoted one tier down; past
the last tier they are dropped (the token log in Redis can rebuild them). A get
from a lower tier promotes the blob back to the device tier.

Host and disk copies carry a checksum; a mismatch or a truncated file is a miss
(the caller rebuilds), never loaded. Byte accounting is exact: a tier's
``bytes_used`` is the sum of the bytes it stores.

A tier may store KIVI-quantized KV (``kivi=KIVI(bits=2)``, see ``policies/kivi.py``): it
packs a blob on the way in and hands back a dequantized one; a packed blob moves between
tiers with the same KIVI settings as it is (never quantized twice).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load, save

from kvsnap.policies import LRU
from kvsnap.policies.kivi import KIVI, unpack

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVBlob:
    """One session's KV at rest: ``[k_0, v_0, k_1, v_1, ...]`` plus the lengths to rebuild the cache.

    A KIVI-packed blob has ``layout`` (one entry per original tensor) and its ``tensors`` are
    the packed parts; :meth:`unpacked` gives the dequantized tensors back. An ``exact`` blob is
    never quantized, whatever the tier's KIVI settings (a re-selection session's full copy: its
    rows are scored and copied back every turn, so they stay at full precision)."""

    tensors: list[torch.Tensor]
    logical_len: int
    version: int  # the directory version this KV belongs to
    checksum: str = ""
    layout: list[dict] | None = None
    exact: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def compute_checksum(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.logical_len}:{self.version}".encode())
        if self.layout is not None:
            h.update(json.dumps(self.layout, sort_keys=True).encode())
        for t in self.tensors:
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def to(self, device: torch.device | str, pin: bool = False) -> KVBlob:
        moved = [t.to(device) for t in self.tensors]
        if pin:
            moved = [t.pin_memory() for t in moved]
        return KVBlob(moved, self.logical_len, self.version, self.checksum, self.layout, self.exact)

    def packed(self, kivi: KIVI) -> KVBlob:
        parts, layout = kivi.pack(self.tensors)
        return KVBlob(parts, self.logical_len, self.version, "", layout)

    def unpacked(self) -> KVBlob:
        if self.layout is None:
            return self
        return KVBlob(unpack(self.tensors, self.layout), self.logical_len, self.version)

    def packed_by(self, kivi: KIVI | None) -> bool:
        """True when this blob is stored exactly as ``kivi`` (None: unquantized) would store it."""
        if self.layout is None or kivi is None:
            return self.layout is None and kivi is None
        want = kivi.settings()
        return all({k: m[k] for k in want} == want for m in self.layout)


def blob_to_bytes(blob: KVBlob) -> bytes:
    """A self-checking serialisation (safetensors + checksum in its metadata): disk tier and hand-over."""
    tensors = {f"t{i}": t.detach().contiguous().cpu() for i, t in enumerate(blob.tensors)}
    meta = {
        "logical_len": str(blob.logical_len),
        "version": str(blob.version),
        "n": str(len(tensors)),
        "checksum": blob.compute_checksum(),
    }
    if blob.layout is not None:
        meta["layout"] = json.dumps(blob.layout)
    if blob.exact:
        meta["exact"] = "1"
    return save(tensors, metadata=meta)


def blob_from_bytes(data: bytes) -> KVBlob:
    """Inverse of :func:`blob_to_bytes`; raises ValueError on a truncated, garbled or mismatching blob."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
        loaded = load(data)
        blob = KVBlob(
            [loaded[f"t{i}"] for i in range(int(meta["n"]))],
            int(meta["logical_len"]),
            int(meta["version"]),
            meta["checksum"],
            json.loads(meta["layout"]) if "layout" in meta else None,
            meta.get("exact") == "1",
        )
    except Exception as exc:
        raise ValueError(f"unreadable KV blob: {exc}") from exc
    if blob.compute_checksum() != blob.checksum:
        raise ValueError("KV blob checksum mismatch")
    return blob


class Tier:
    """A byte-budgeted map from session key to blob with LRU order. Subclasses store blobs."""

    name = "tier"

    def __init__(self, budget_bytes: int, kivi: KIVI | None = None):
        if budget_bytes < 0:
            raise ValueError(f"{self.name} tier budget must be >= 0")
        self.budget = budget_bytes
        self.kivi = kivi  # store KIVI-quantized KV (None: as given)
        self.lru = LRU()
        self.sizes: dict[str, int] = {}

    @property
    def bytes_used(self) -> int:
        return sum(list(self.sizes.values()))  # list(): a consistent copy while a turn may be writing

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def put(self, key: str, blob: KVBlob) -> None:
        kivi = None if blob.exact else self.kivi
        if not blob.packed_by(kivi):
            blob = blob.unpacked()
            if kivi is not None:
                blob = blob.packed(kivi)
        self._store(key, blob)
        self.sizes[key] = blob.nbytes
        self.lru.touch(key)

    def take(self, key: str, raw: bool = False) -> KVBlob | None:
        """Remove and return the blob (``raw``: as stored, maybe KIVI-packed); None (and removed)
        when it fails its checksum."""
        if key not in self.sizes:
            return None
        blob = self._load(key)
        self.discard(key)
        return blob if raw or blob is None else blob.unpacked()

    def read(self, key: str) -> KVBlob | None:
        """The blob (dequantized), left in place and touched as recently used; None (and
        removed) when it fails its checksum."""
        if key not in self.sizes:
            return None
        blob = self._load(key)
        if blob is None:
            self.discard(key)
            return None
        self.lru.touch(key)
        return blob.unpacked()

    def discard(self, key: str) -> None:
        if self.sizes.pop(key, None) is not None:
            self.lru.remove(key)
            self._delete(key)

    # storage hooks
    def _store(self, key: str, blob: KVBlob) -> None: ...
    def _load(self, key: str) -> KVBlob | None: ...
    def _delete(self, key: str) -> None: ...


class DeviceTier(Tier):
    """GPU memory, or CPU memory with its own budget where there is no GPU. No copies, no checksum."""

    name = "device"

    def __init__(self, budget_bytes: int, device: torch.device | str = "cpu", kivi: KIVI | None = None):
        super().__init__(budget_bytes, kivi)
        self.device = torch.device(device)
        self.blobs: dict[str, KVBlob] = {}

    def _store(self, key, blob):
        self.blobs[key] = blob.to(self.device)

    def _load(self, key):
        return self.blobs[key]

    def _delete(self, key):
        self.blobs.pop(key, None)


class HostTier(Tier):
    """CPU memory (pinned when CUDA is present, for fast promotion), checksummed."""

    name = "host"

    def __init__(self, budget_bytes: int, kivi: KIVI | None = None):
        super().__init__(budget_bytes, kivi)
        self.pin = torch.cuda.is_available()
        self.blobs: dict[str, KVBlob] = {}

    def _store(self, key, blob):
        host = blob.to("cpu", pin=self.pin)
        host.checksum = host.compute_checksum()
        self.blobs[key] = host

    def _load(self, key):
        blob = self.blobs[key]
        if blob.compute_checksum() != blob.checksum:
            log.warning("host tier: checksum mismatch for %s; treating as a miss", key)
            return None
        return blob

    def _delete(self, key):
        self.blobs.pop(key, None)


class DiskTier(Tier):
    """One safetensors file per session in ``directory``, checksummed; a bad file is a miss."""

    name = "disk"

    def __init__(self, budget_bytes: int, directory: str | os.PathLike, kivi: KIVI | None = None):
        super().__init__(budget_bytes, kivi)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / (
            re.sub(r"[^A-Za-z0-9._-]", "_", key) + "-" + hashlib.sha1(key.encode()).hexdigest()[:8] + ".safetensors"
        )

    def _store(self, key, blob):
        tmp = self.path(key).with_suffix(".tmp")
        tmp.write_bytes(blob_to_bytes(blob))
        tmp.replace(self.path(key))

    def _load(self, key):
        try:
            return blob_from_bytes(self.path(key).read_bytes())
        except (OSError, ValueError) as exc:
            log.warning("disk tier: bad blob for %s (%s); treating as a miss", key, exc)
            return None

    def _delete(self, key):
        self.path(key).unlink(missing_ok=True)


@dataclass(slots=True)
class TierStats:
    demotions: Counter = field(default_factory=Counter)  # "device->host": n
    promotions: Counter = field(default_factory=Counter)  # "host->device": n
    dropped: int = 0  # blobs pushed out of the last tier
    corrupt: int = 0  # checksum / read failures (each became a rebuild)


class TieredStore:
    """Tiers composed top (device) to bottom. ``put`` stores on the device tier and demotes
    LRU blobs down while any tier is over budget; ``get`` promotes a hit back to the device."""

    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = tiers
        self.stats = TierStats()
        self.moved: dict[str, str] = {}  # key -> the tier a demotion left it in ("dropped": gone)

    def tier_of(self, key: str) -> str | None:
        return next((t.name for t in self.tiers if key in t), None)

    def put(self, key: str, blob: KVBlob, tier: int = 0) -> str | None:
        """Store ``blob`` (replacing any older copy) in tier ``tier`` (0 = device, or the lowest
        there is); returns the tier it ended up in (None: dropped)."""
        self.discard(key)
        self.tiers[min(tier, len(self.tiers) - 1)].put(key, blob)
        self._enforce_budgets()
        return self.tier_of(key)

    def peek(self, key: str) -> KVBlob | None:
        """The blob, left in its tier (touched as recently used, not promoted); None when absent or corrupt."""
        for tier in self.tiers:
            if key in tier:
                blob = tier.read(key)
                if blob is None:
                    self.stats.corrupt += 1
                return blob
        return None

    def get(self, key: str) -> KVBlob | None:
        """The blob, promoted to the device tier; None when absent or corrupt."""
        for i, tier in enumerate(self.tiers):
            if key not in tier:
                continue
            blob = tier.take(key, raw=True)
            if blob is None:
                self.stats.corrupt += 1
                return None
            if i > 0:
                self.stats.promotions[f"{tier.name}->{self.tiers[0].name}"] += 1
            self.put(key, blob)
            return (self.tiers[0].blobs[key] if key in self.tiers[0] else blob).unpacked()
        return None

    def discard(self, key: str) -> None:
        for tier in self.tiers:
            tier.discard(key)

    def take_moves(self) -> dict[str, str]:
        """Keys that demotions moved (or dropped) since the last call, with where they are now."""
        moved, self.moved = self.moved, {}
        return moved

    def bytes_by_tier(self) -> dict[str, int]:
        return {t.name: t.bytes_used for t in self.tiers}

    def sessions_by_tier(self) -> dict[str, int]:
        return {t.name: len(t.sizes) for t in self.tiers}

    def keys(self) -> list[str]:
        return [k for t in self.tiers for k in t.sizes]

    def _enforce_budgets(self) -> None:
        for i, tier in enumerate(self.tiers):
            while tier.bytes_used > tier.budget:
                victim = tier.lru.coldest()
                blob = tier.take(victim, raw=True)
                if i + 1 < len(self.tiers) and blob is not None:
                    self.tiers[i + 1].put(victim, blob)
                    self.stats.demotions[f"{tier.name}->{self.tiers[i + 1].name}"] += 1
                    self.moved[victim] = self.tiers[i + 1].name
                    continue
                self.moved[victim] = "dropped"
                if blob is None:
                    self.stats.corrupt += 1
                else:
                    self.stats.dropped += 1
                    log.info("tiers: dropped the KV of %s (every tier full); it will be rebuilt", victim)


def build_store(
    device_bytes: int,
    host_bytes: int,
    disk_bytes: int = 0,
    disk_dir: str | None = None,
    device: torch.device | str = "cpu",
    kivi: KIVI | None = None,
    kivi_device: bool = False,
) -> TieredStore:
    """device + host tiers, plus a disk tier when ``disk_bytes`` > 0 and ``disk_dir`` is given.

    ``kivi``: the host and disk tiers store KIVI-quantized KV (and the device tier too with
    ``kivi_device``)."""
    tiers: list[Tier] = [DeviceTier(device_bytes, device, kivi if kivi_device else None), HostTier(host_bytes, kivi)]
    if disk_bytes > 0:
        if not disk_dir:
            raise ValueError("a disk tier needs a directory")
        tiers.append(DiskTier(disk_bytes, disk_dir, kivi))
    return TieredStore(tiers)
