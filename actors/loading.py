"""Loading a session for a turn: its KV at the directory's version from a tier (device / host /
disk), else a drained holder's hand-over, else a replay of its token log (``Engine.rebuild``).

A mixin of :class:`~.sessions.SessionStore` (its engine, directory, tiers, lock and counters).
"""

from __future__ import annotations

import logging

from kvsnap.engine.cache import full_layer_indices, import_kv
from kvsnap.engine.session import Session, TurnMark
from kvsnap.errors import Conflict, Unavailable
from kvsnap.policies import Policy, policy_from_json
from kvsnap.store.directory import SessionEntry
from kvsnap.store.tiers import KVBlob, blob_from_bytes

from .held import Held, full_key

log = logging.getLogger(__name__)


class Loading:
    """:meth:`load`: a session at its entry's version, and where its KV came from."""

    def load(self, key: str, entry: SessionEntry) -> tuple[Session, str]:
        """The session at the entry's version and where its KV came from: a tier (device / host /
        disk), a drained holder's hand-over ("imported"), or a replay of its log ("rebuilt")."""
        with self.lock:
            held, policy = self._current(key, entry)
            session = self.engine.new_session(policy, entry.recompress, entry.session_id)
            session.turns = entry.turns
            tier = self.tiers.tier_of(key)
            blob = self.tiers.get(key) if held is not None else None
            if blob is not None and blob.version == entry.version:
                self._restore(session, entry, blob, held.transcript, held.marks, self.tiers.peek(full_key(key)))
                self.counters[f"hit_{tier}"] += 1
                return session, tier
            if entry.owner and entry.owner != self.worker_id:
                self.counters["moves_in"] += 1
                log.info("session %s moves from worker %s to %s", key, entry.owner, self.worker_id)
            imported = self._import(entry)
            if imported is not None:
                tokens, marks = self._log(entry)
                self._restore(session, entry, imported, tokens, marks, self._import(entry, part="full"))
                self.counters["imports"] += 1
                return session, "imported"
            if entry.log_len == 0 and entry.turns == 0:
                raise Conflict(
                    f"session {entry.session_id!r} is still being opened (its first turn has not been committed); "
                    "retry, or open it again if that turn failed"
                )
        self._rebuild(session, entry, held)  # model work: outside the store's lock (heartbeats go on)
        self.counters["rebuilds"] += 1
        return session, "rebuilt"

    def _current(self, key: str, entry: SessionEntry) -> tuple[Held | None, Policy]:
        """This worker's copy of the session when it is at the entry's version (else None), and
        the session's policy: the held object then, else the one the entry describes. Called
        under the store's lock."""
        held = self.held.get(key)
        if held is None or held.entry.version != entry.version:
            return None, policy_from_json(entry.policy)
        return held, held.policy if held.policy is not None else policy_from_json(entry.policy)

    def _restore(self, session, entry, blob: KVBlob, transcript, marks, full: KVBlob | None) -> None:
        session.cache = import_kv(self.engine.model.config, blob.tensors, blob.logical_len, blob.cold)
        session.logical_len = blob.logical_len
        session.transcript = list(transcript)
        session.marks = list(marks)
        if session.policy.reselects:
            self._attach_full_copy(entry, session, full)

    def _rebuild(self, session: Session, entry: SessionEntry, held: Held | None) -> None:
        """Replay the session's turns from its token log (this worker's copy when current)."""
        transcript, marks = (held.transcript, held.marks) if held is not None else self._log(entry)
        if len(transcript) != entry.log_len:
            raise Unavailable(
                f"token log of {entry.session_id!r} has {len(transcript)} tokens, expected {entry.log_len}; retry"
            )
        if transcript:
            self.replay(session, transcript, entry.logical_len or len(transcript), marks)

    def _log(self, entry: SessionEntry) -> tuple[list[int], list[TurnMark]]:
        """The session's token log and turn marks, from the directory."""
        tenant, session_id = entry.tenant, entry.session_id
        return self.directory.tokens(tenant, session_id), self.directory.marks(tenant, session_id)

    def _import(self, entry: SessionEntry, part: str = "") -> KVBlob | None:
        """A KV blob handed over by a draining worker, if it is of this entry's version."""
        data = self.directory.take_export(entry.tenant, entry.session_id, part)
        if data is None:
            return None
        try:
            blob = blob_from_bytes(data)
        except ValueError as exc:
            log.warning("hand-over blob of %s unusable (%s); rebuilding", entry.session_id, exc)
            return None
        if part:  # the full copy: checked against the version when attached
            return blob
        return blob if blob.version == entry.version and blob.logical_len == entry.logical_len else None

    def _attach_full_copy(self, entry: SessionEntry, session: Session, blob: KVBlob | None) -> None:
        """Give a reselect session its full copy back (from a tier, or handed over by a drained
        worker) when it is current; without one the session goes on as plain SnapKV."""
        if blob is None or blob.version != entry.version:
            self.counters["reselect_fallbacks"] += 1
            return
        layers = full_layer_indices(session.cache)
        session.full_kv = {idx: (blob.tensors[2 * n], blob.tensors[2 * n + 1]) for n, idx in enumerate(layers)}
        session.full_len = blob.logical_len
