"""A worker's sessions beyond its turns: the hand-over of a drain (every held session's KV
through Redis), the heartbeat, and the re-registration of sessions Redis lost or missed.

A mixin of :class:`~.sessions.SessionStore` (its directory, tiers, held map and lock).
"""

from __future__ import annotations

import time

from kvsnap.errors import Unavailable
from kvsnap.store.tiers import blob_to_bytes

from .held import copy_entry, full_key


class Liveness:
    """:meth:`export_all` (a drain's hand-over) and :meth:`heartbeat` (with re-registration)."""

    # -- hand-over (drain) -----------------------------------------------------------------
    def export_all(self) -> int:
        """Hand every held session's KV over through Redis (a reselect session's full copy
        too), so the replicas that get these sessions next import it instead of re-prefilling.
        Returns how many were exported; the rest are rebuilt from the log where they land."""
        exported = 0
        with self.lock:
            for key, held in list(self.held.items()):
                blob = self.tiers.get(key)
                if blob is None or blob.version != held.entry.version or held.dirty:
                    continue  # nothing trustworthy to hand over: the next worker rebuilds from the log
                full = self.tiers.peek(full_key(key))
                tenant, session_id = held.entry.tenant, held.entry.session_id
                try:
                    self.directory.put_export(tenant, session_id, blob_to_bytes(blob))
                    if full is not None and full.version == blob.version:
                        self.directory.put_export(tenant, session_id, blob_to_bytes(full), part="full")
                    exported += 1
                except Unavailable:
                    break
                self.forget(key)
        self.counters["exported"] += exported
        return exported

    # -- liveness and re-registration ----------------------------------------------------
    def heartbeat(self, load=None) -> None:
        """Refresh this worker's heartbeat (then publish ``load()``, its numbers); re-register
        held sessions Redis lost or missed; forget sessions idle past the TTL."""
        alive = self.directory.worker_alive(self.worker_id, self.epoch)
        self.directory.heartbeat(self.worker_id, self.epoch)
        if load is not None:
            self.directory.publish_load(self.worker_id, load())
        self._expire_idle()
        with self.lock:
            todo = [k for k, h in self.held.items() if h.dirty or not alive]
        for key in todo:
            self._resync(key)

    def _resync(self, key: str) -> None:
        with self.lock:
            held = self.held.get(key)
            if held is None:
                return
            entry = copy_entry(held.entry)
            entry.tier = self.tiers.tier_of(key) or "dropped"
            if self.directory.restore(entry, held.transcript, held.messages, held.marks):
                self.counters["resyncs"] += 1
            held.dirty = False

    def _expire_idle(self) -> None:
        """Forget sessions idle past the directory TTL (Redis expired them too)."""
        cutoff = time.time() - self.directory.session_ttl_s
        with self.lock:
            for key in [k for k, h in self.held.items() if h.entry.last_used < cutoff and not h.dirty]:
                self.forget(key)
