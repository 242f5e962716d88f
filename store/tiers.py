"""Tiered session-KV store: device -> host -> disk, each with a byte budget.

A session's compressed KV (a :class:`KVBlob`) lives in exactly one tier. When a
tier is over budget the blobs whose next turn is due last (``policies/eviction.py``'s
:class:`NextUse`: not LRU, which drops every session just before its turn when a cycle of
conversations outgrows the tiers) are demoted one tier down; past the last tier they are
dropped (the token log in Redis can rebuild them). A get from a lower tier promotes the
blob back to the device tier.

Tenants share the tiers fairly: abandoned sessions go first, whoever's they are; then the
victim is the session due last of the tenant holding the most bytes in the tier, which is over
its share (the budget split among the tenants there) whenever the tier is over budget. So a
tenant opening sessions in volume pushes out its own, not another tenant's live ones.

Host and disk copies carry a checksum; a mismatch or a truncated file is a miss
(the caller rebuilds), never loaded. Byte accounting is exact: a tier's
``bytes_used`` is the sum of the bytes it stores.

A tier may store KIVI-quantized KV (``kivi=KIVI(bits=2)``, see ``policies/kivi.py``): it
packs a blob on the way in and hands back a dequantized one; a packed blob moves between
tiers with the same KIVI settings as it is (never quantized twice). The blob itself and its
bytes on disk or in a hand-over are in :mod:`.blobs`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsnap.policies import LRU, NextUse
from kvsnap.policies.kivi import KIVI

from .blobs import KVBlob, blob_from_bytes, blob_to_bytes

__all__ = [
    "DeviceTier",
    "DiskTier",
    "HostTier",
    "KVBlob",
    "TieredStore",
    "blob_from_bytes",
    "blob_to_bytes",
    "build_store",
]

log = logging.getLogger(__name__)


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
    the blobs due last (:class:`NextUse`) down while any tier is over budget; ``get`` promotes
    a hit back to the device."""

    def __init__(self, tiers: list[Tier], order: NextUse | None = None):
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = tiers
        self.order = order or NextUse()  # each key's uses: a put is one (a turn's commit)
        self.stats = TierStats()
        self.moved: dict[str, str] = {}  # key -> the tier a demotion left it in ("dropped": gone)

    def tier_of(self, key: str) -> str | None:
        return next((t.name for t in self.tiers if key in t), None)

    def put(self, key: str, blob: KVBlob, tier: int = 0) -> str | None:
        """Store ``blob`` (replacing any older copy) in tier ``tier`` (0 = device, or the lowest
        there is); returns the tier it ended up in (None: dropped). It counts as a use of ``key``."""
        self.order.used(key)
        return self._place(key, blob, tier)

    def _place(self, key: str, blob: KVBlob, tier: int = 0) -> str | None:
        self._remove(key)
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
            self._place(key, blob)  # not a use: the turn that reads it commits one
            return (self.tiers[0].blobs[key] if key in self.tiers[0] else blob).unpacked()
        return None

    def discard(self, key: str) -> None:
        self._remove(key)
        self.order.forget(key)

    def _remove(self, key: str) -> None:
        """Every tier's copy of ``key`` gone (its use history kept: :meth:`discard` forgets it)."""
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
                victim = self.order.victim(tier.lru, tier.sizes)  # tenants share the tier
                blob = tier.take(victim, raw=True)
                if i + 1 < len(self.tiers) and blob is not None:
                    self.tiers[i + 1].put(victim, blob)
                    self.stats.demotions[f"{tier.name}->{self.tiers[i + 1].name}"] += 1
                    self.moved[victim] = self.tiers[i + 1].name
                    continue
                self.moved[victim] = "dropped"
                self.order.forget(victim)
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
