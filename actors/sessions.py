"""A worker's sessions: where each one's KV is, and how a turn gets one and gives it back.

Redis is a hint, the worker is the truth. A session's KV is reused only when the tiers hold
the directory's version of it; else a draining worker's hand-over is imported, else the
session is rebuilt from the token log by replaying its turns (``Engine.rebuild``), so
nothing is lost while the log survives. While Redis is down, sessions this worker holds go
on (their commits are replayed when Redis returns); others fail with ``Unavailable``.

A turn asks once and gives back once: :meth:`SessionStore.checkout` claims the session and
hands it over ready (registered when new, loaded at the directory's version: :mod:`.loading`,
or taken back to a turn boundary: :mod:`.rewinds`); :meth:`SessionStore.checkin` commits it
(or drops what the turn did). Claims are in :mod:`.claims`; an implicit session's content is
recorded by :mod:`.conversations`; the hand-over of a drain and re-registration after a Redis
loss by :mod:`.liveness`. Turn execution is elsewhere (:mod:`.worker`): this module knows
nothing of decoding.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager

from kvsnap.engine.cache import export_kv
from kvsnap.engine.cold import export_cold
from kvsnap.engine.engine import Engine
from kvsnap.engine.session import Session
from kvsnap.errors import Conflict, NotFound, Unavailable
from kvsnap.policies import policy_to_json
from kvsnap.store.directory import SessionDirectory, SessionEntry, check_id
from kvsnap.store.tiers import KVBlob, TieredStore

from .claims import Claims
from .conversations import record_conversation
from .held import Held, Lease, copy_entry, full_key
from .liveness import Liveness
from .loading import Loading
from .rewinds import Rewinds
from .turns import TurnRequest

log = logging.getLogger(__name__)


class SessionStore(Loading, Rewinds, Liveness):
    def __init__(self, engine: Engine, directory: SessionDirectory, tiers: TieredStore, worker_id: str):
        self.engine = engine  # builds sessions and rebuilds lost KV
        self.directory = directory
        self.tiers = tiers
        self.worker_id = check_id("worker id", worker_id)
        self.epoch = time.time_ns()  # incarnation: a restarted worker never reuses one
        self.held: dict[str, Held] = {}
        self.counters: Counter = Counter()  # rebuilds, tier hits, imports, offline turns, resyncs, conflicts
        self.lock = threading.RLock()  # the held map and the tiers
        # a lost session's turns replayed (engine/replay.py): alone under this store's own model
        # lock, unless a worker replays them in its batch (Worker._replay)
        self.model_lock = threading.RLock()
        self.replay = self._replay_alone
        self.claims = Claims()  # sessions with a turn in progress
        self.claimed, self.wait_idle = self.claims.claimed, self.claims.wait_idle
        self.draining = False  # set by a drain: turns on held sessions are refused, new sessions not

    def _replay_alone(self, session: Session, transcript: list[int], logical_len: int, marks: list) -> None:
        with self.model_lock:
            self.engine.rebuild(session, transcript, logical_len, marks)

    # -- one turn: checkout and checkin --------------------------------------------------
    @contextmanager
    def checkout(self, req: TurnRequest, fresh: Session | None = None):
        """The turn's session, ready to run: claimed (a second concurrent turn gets Conflict),
        then registered (``fresh``: a new session, built and checked by the worker), or loaded
        at the directory's version, or taken back to a turn boundary (``req.keep_turns``). An
        error, here or in the caller's block, releases the claim; otherwise the lease holds it
        until :meth:`checkin` (or the turn's stream releases it)."""
        with self.claimed(req.key) as claim:
            if fresh is not None:
                yield Lease(claim, self._open(req, fresh), fresh, "new")
                return
            if self.draining:
                raise Unavailable("worker is draining; retry (the session moves to another worker)")
            entry = self.entry(req.tenant, req.session_id)
            if req.expected_version and entry.version != req.expected_version:
                raise Conflict(
                    f"session {req.session_id!r} changed since this turn was built on it "
                    f"(version {entry.version}, expected {req.expected_version})"
                )
            if req.keep_turns is not None:  # back to a turn boundary first (replayed, as a rebuild)
                session, kept, replayed = self.rewound(req.key, entry, req.keep_turns, req.keep_prompt)
                yield Lease(claim, entry, session, "rewound", kept, replayed)
            else:  # a rebuild replays the session in the batch (Worker._replay)
                session, source = self.load(req.key, entry)
                yield Lease(claim, entry, session, source)

    def checkin(self, lease: Lease, messages: list[dict] | None, turn_id: str = "") -> None:
        """Give the turn's session back: commit it with the turn's ``messages``, or (None) drop
        what the turn did (its KV is not trusted; a session it was opening is deleted)."""
        key = lease.claim.key
        lease.claim.end()  # a turn arriving from now on is the next one: it waits, not Conflict
        if messages is not None:
            self.commit(key, lease.entry, lease.session, messages, turn_id, lease.kept)
            return
        self.forget(key)
        if lease.source == "new":
            self.directory.delete(lease.entry.tenant, lease.entry.session_id)

    def _open(self, req: TurnRequest, session: Session) -> SessionEntry:
        """Register ``session``, new, under the request's id."""
        entry = SessionEntry(
            req.tenant,
            req.session_id,
            policy=policy_to_json(session.policy),
            policy_fingerprint=session.policy.fingerprint(),
            model=self.engine.loaded.fingerprint,
            recompress=session.recompress,
            conversation=req.conversation,
        )
        self.create(entry)
        return entry

    # -- reading -------------------------------------------------------------------------
    def entry(self, tenant: str, session_id: str) -> SessionEntry:
        """The directory entry; while Redis is down, this worker's own copy of a session it holds."""
        key = f"{tenant}/{session_id}"
        try:
            entry = self.directory.get(tenant, session_id)
            if entry is None and key in self.held and not self.directory.worker_alive(self.worker_id, self.epoch):
                self.heartbeat()  # Redis came back empty: put our sessions back first
                entry = self.directory.get(tenant, session_id)
        except Unavailable:
            held = self.held.get(key)
            if held is None:
                raise
            self.counters["offline_turns"] += 1
            return copy_entry(held.entry)
        if entry is None:
            raise NotFound(f"session {session_id!r} not found")
        held = self.held.get(key)
        if held and held.dirty and held.entry.version > entry.version:
            # our turns while Redis was down are newer: write them back before this turn, whose
            # commit follows them (else its compare-and-set would fail and they would be lost)
            with contextlib.suppress(Unavailable):  # still unreachable: this turn's commit stays local too
                self._resync(key)
            return copy_entry(held.entry)
        return entry

    def messages(self, tenant: str, session_id: str) -> list[dict]:
        """The session's message log; this worker's copy while Redis is down."""
        key = f"{tenant}/{session_id}"
        try:
            return self.directory.messages(tenant, session_id)
        except Unavailable:
            if key in self.held:
                return list(self.held[key].messages)
            raise

    def create(self, entry: SessionEntry) -> None:
        """Register a new session (version 1, empty log: its first commit carries the tokens). An
        entry whose first turn never committed (its replica died while opening it) is replaced."""
        existing = self.directory.get(entry.tenant, entry.session_id)
        if existing is not None:
            if existing.log_len or existing.turns or existing.version > 1:
                raise Conflict(f"session {entry.session_id!r} already exists")
            self.directory.delete(entry.tenant, entry.session_id)
        self.directory.create(entry, [])

    def commit(
        self,
        key: str,
        entry: SessionEntry,
        session: Session,
        messages: list[dict],
        turn_id: str = "",
        kept: list[dict] | None = None,
    ) -> None:
        """Store the session's KV (version + 1) and compare-and-set its directory entry, token log,
        turn mark and messages; while Redis is down, keep the commit to replay it later.
        ``kept``: the session was taken back to a turn boundary first (:meth:`rewound`) and kept
        these messages: its logs are rewritten whole, under the same compare-and-set."""
        with self.lock:
            expected, logged = entry.version, entry.log_len
            updated = copy_entry(entry)
            updated.owner, updated.epoch, updated.last_turn = self.worker_id, self.epoch, turn_id
            updated.logical_len, updated.kept_len = session.logical_len, session.kept_len
            updated.kv_bytes, updated.turns = session.kv_bytes, session.turns
            cold = export_cold(session.cache)  # a mixed-precision session's quantized rows (engine/cold.py)
            blob = KVBlob(export_kv(session.cache), session.logical_len, version=expected + 1, cold=cold)
            updated.tier = self.tiers.put(key, blob) or "dropped"
            self._store_full_copy(key, session, expected + 1)
            held = self.held.get(key)
            if session.marks:  # the turn's mark counts its messages: where a later rewind can end
                session.marks[-1].messages = len(messages)
            all_messages = (self._messages_before(entry, held) if kept is None else kept) + messages
            try:  # one commit per turn: its mark is the session's last
                if kept is None:
                    self.directory.commit(updated, expected, session.transcript[logged:], messages, session.marks[-1:])
                else:
                    self.directory.rewrite(updated, expected, session.transcript, all_messages, session.marks)
            except Conflict:
                self.forget(key)
                self.counters["conflicts"] += 1
                raise
            except Unavailable:
                updated.version, updated.log_len = expected + 1, len(session.transcript)
                self.held[key] = self._held(updated, session, all_messages, dirty=True)
                log.warning("commit of %s deferred: Redis unavailable", key)
                return
            self.held[key] = self._held(updated, session, all_messages)
            self._record_moves()
        if entry.conversation:  # an implicit session: resumable by its content (a hint; never fails a turn)
            record_conversation(self.directory, key, entry, all_messages)

    def _messages_before(self, entry: SessionEntry, held: Held | None) -> list[dict]:
        """The session's message log before this turn: this worker's copy when it holds the
        session's current version, else the directory's (a session that moved here)."""
        if held is not None and held.entry.version == entry.version:
            return held.messages
        if entry.log_len == 0:  # a session being opened: nothing logged yet (no read on every open)
            return []
        try:
            return self.directory.messages(entry.tenant, entry.session_id)
        except Unavailable:
            return []  # unknown while Redis is down: the log in Redis keeps it, the local copy lacks it

    @staticmethod
    def _held(entry: SessionEntry, session: Session, messages: list[dict], dirty: bool = False) -> Held:
        return Held(entry, list(session.transcript), messages, list(session.marks), session.policy, dirty)

    def _store_full_copy(self, key: str, session: Session, version: int) -> None:
        """A Reselect policy: the full copy goes to the host tier (never the device tier),
        where the tiers' order demotes or drops it like any other blob. It is kept at full precision
        (``exact``) even where the tiers quantize KV (kv_quant): re-selection scores its rows
        and copies them to the device every turn."""
        if session.full_kv is None:
            self.tiers.discard(full_key(key))
            return
        tensors = [t for idx in sorted(session.full_kv) for t in session.full_kv[idx]]
        self.tiers.put(full_key(key), KVBlob(tensors, session.full_len, version, exact=True), tier=1)

    def forget(self, key: str) -> None:
        """Drop this worker's KV and knowledge of a session (its log in Redis stays)."""
        with self.lock:
            self.tiers.discard(key)
            self.tiers.discard(full_key(key))
            self.held.pop(key, None)

    def delete(self, tenant: str, session_id: str) -> None:
        key = f"{tenant}/{session_id}"
        with self.claimed(key) as claim, claim:
            existed = self.directory.delete(tenant, session_id)
            held = self.held.get(key)
            self.forget(key)
        if not existed and held is None:
            raise NotFound(f"session {session_id!r} not found")

    def _record_moves(self) -> None:
        """Tell the directory where demotions left other sessions' KV (best effort: a stale tier
        only misreports the state; a turn still finds the KV in whatever tier it is)."""
        for key, tier in self.tiers.take_moves().items():
            held = self.held.get(key)  # None for full copies (".../full"): not in the directory
            if held is None:
                continue
            held.entry.tier = tier
            try:
                self.directory.set_tier(held.entry.tenant, held.entry.session_id, self.worker_id, self.epoch, tier)
            except Unavailable:
                log.info("tier of %s not recorded: Redis unavailable", key)

    def stats(self) -> dict:
        return {
            "held": len(self.held),
            "bytes_by_tier": self.tiers.bytes_by_tier(),
            "sessions_by_tier": self.tiers.sessions_by_tier(),
            "demotions": dict(self.tiers.stats.demotions),
            "promotions": dict(self.tiers.stats.promotions),
            "dropped": self.tiers.stats.dropped,
            "corrupt": self.tiers.stats.corrupt,
            **self.counters,
        }
