"""A worker's sessions: where each one's KV is, and how it is loaded, committed, handed over.

Redis is a hint, the worker is the truth. A session's KV is reused only when the tiers hold
the directory's version of it; else a draining worker's hand-over is imported, else the
session is rebuilt from the token log by replaying its turns (``Engine.rebuild``), so
nothing is lost while the log survives. While Redis is down, sessions this worker holds go
on (their commits are replayed when Redis returns); others fail with ``Unavailable``.

Turn execution is elsewhere (:mod:`.worker`): this module knows nothing of decoding.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvsnap.engine.cache import export_kv, full_layer_indices, import_kv
from kvsnap.engine.engine import Engine
from kvsnap.engine.session import Session, TurnMark, marks_cover
from kvsnap.errors import Conflict, NotFound, Unavailable
from kvsnap.policies import Policy, policy_from_json
from kvsnap.store.directory import SessionDirectory, SessionEntry, check_id
from kvsnap.store.tiers import KVBlob, TieredStore, blob_from_bytes, blob_to_bytes

from .turns import turn_boundaries

log = logging.getLogger(__name__)
ANSWER_ROLES = {"assistant", "completion"}  # how a turn's answer is logged


@dataclass(slots=True)
class Held:
    """What this worker knows of a session it holds (the KV itself is in the tiers)."""

    entry: SessionEntry  # as last committed (or to be replayed, when ``dirty``)
    transcript: list[int]
    messages: list[dict]  # the message log (HTTP / OpenAI APIs), for re-registration
    marks: list[TurnMark] = field(default_factory=list)  # each turn's place in the transcript (replays)
    policy: Policy | None = None  # the entry's policy, built once
    dirty: bool = False  # committed locally while Redis was unreachable


class Claim:
    """One turn's hold on a session: a second concurrent turn gets Conflict. ``release`` is
    idempotent and never frees a later turn's claim; as a context manager it releases on exit."""

    __slots__ = ("key", "owner")

    def __init__(self, key: str, owner: SessionStore):
        self.key, self.owner = key, owner

    def release(self) -> None:
        with self.owner._busy_lock:
            if self.owner._busy.get(self.key) is self:
                del self.owner._busy[self.key]

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SessionStore:
    def __init__(self, engine: Engine, directory: SessionDirectory, tiers: TieredStore, worker_id: str):
        self.engine = engine  # builds sessions and rebuilds lost KV
        self.directory = directory
        self.tiers = tiers
        self.worker_id = check_id("worker id", worker_id)
        self.epoch = time.time_ns()  # incarnation: a restarted worker never reuses one
        self.held: dict[str, Held] = {}
        self.counters: Counter = Counter()  # rebuilds, tier hits, imports, offline turns, resyncs, conflicts
        self.lock = threading.RLock()  # the held map and the tiers
        self.model_lock = threading.RLock()  # the model's (the worker's): a rebuild runs it between batch steps
        self._busy: dict[str, Claim] = {}  # sessions with a turn in progress
        self._busy_lock = threading.Lock()

    # -- claims --------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no turn holds a claim (True: every turn in progress has committed), or
        ``timeout_s`` has passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._busy:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    @contextmanager
    def claimed(self, key: str):
        """Claim ``key`` (one turn per session at a time: a second concurrent one gets Conflict,
        HTTP 409, before any model work). Released on an error; on success the caller keeps the
        claim (a turn's stream releases it when it ends) or releases it."""
        with self._busy_lock:
            if key in self._busy:
                raise Conflict("another turn on this session is in progress")
            claim = Claim(key, self)
            self._busy[key] = claim
        try:
            yield claim
        except BaseException:
            claim.release()
            raise

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
            return _copy(held.entry)
        if entry is None:
            raise NotFound(f"session {session_id!r} not found")
        held = self.held.get(key)
        if held and held.dirty and held.entry.version > entry.version:
            # our turns while Redis was down are newer: write them back before this turn, whose
            # commit follows them (else its compare-and-set would fail and they would be lost)
            with contextlib.suppress(Unavailable):  # still unreachable: this turn's commit stays local too
                self._resync(key)
            return _copy(held.entry)
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
                self._restore(session, entry, blob, held.transcript, held.marks, self.tiers.peek(_full_key(key)))
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

    def rewound(
        self, key: str, entry: SessionEntry, keep: int, prompt: bool = False
    ) -> tuple[Session, list[dict], int]:
        """The session as it was after its first ``keep`` turns (a request diverged from its
        history there), replayed from its logs as a rebuild does: each turn prefilled and
        compressed where it ran, so the KV is exactly the one the session had at that boundary.
        ``prompt``: also turn ``keep + 1``'s prompt, its answer dropped (a request that repeats
        the prompt and re-formats the answer). For the last turn that is the held KV with the
        answer's rows cut off when :meth:`_cut_answer` can do it exactly, else a replay too.
        Returns the session, the messages it kept, and the tokens replayed. What is held stays
        until the new turn commits (the logs are then rewritten: :meth:`commit` with ``kept``)."""
        with self.lock:
            held, policy = self._current(key, entry)
            if held is not None:
                tokens, marks, messages = list(held.transcript), list(held.marks), list(held.messages)
        if held is None:
            tokens, marks = self._log(entry)
            messages = self.directory.messages(entry.tenant, entry.session_id)
        bounds = turn_boundaries(messages, marks)
        turns = keep + 1 if prompt else keep  # whole turns kept, and a prompt-only one
        answered = prompt and keep < len(marks) and marks[keep].generated > 0 and marks[keep].messages > 1
        if (
            not bounds
            or len(marks) != entry.turns
            or not 0 < turns <= len(marks) - (0 if prompt else 1)
            or (prompt and (not answered or messages[bounds[keep] - 1]["role"] not in ANSWER_ROLES))
            or not marks_cover(marks, len(tokens))
        ):
            what = f"the prompt of its turn {keep + 1}" if prompt else f"its turn {keep}"
            raise Conflict(
                f"session {entry.session_id!r} cannot be taken back to {what} "
                f"(it has {len(marks)} turns, logged as {len(bounds)})"
            )
        kept = marks[:keep]
        start = sum(m.prompt + m.generated for m in kept)
        if prompt:  # the turn as it stood before its answer: prefilled and compressed, nothing generated
            m = marks[keep]
            kept = [*kept, TurnMark(m.prompt, 0, start + m.prompt, m.reselected, "", m.messages - 1)]
            start += m.prompt
            kept_messages = messages[: bounds[keep] - 1]
            if turns == len(marks):
                session = self._cut_answer(key, entry, kept, start)
                if session is not None:
                    self.counters["answers_cut"] += 1
                    return session, kept_messages, 0
        else:
            kept_messages = messages[: bounds[keep - 1]]
        session = self.engine.new_session(policy, entry.recompress, entry.session_id)
        with self.model_lock:
            self.engine.rebuild(session, tokens[:start], kept[-1].logical_len, kept)
        session.turns = turns
        self.counters["rewinds"] += 1
        return session, kept_messages, start

    def _cut_answer(self, key: str, entry: SessionEntry, marks: list[TurnMark], upto: int) -> Session | None:
        """The session with its last answer's rows cut off its KV, back to the first ``upto``
        tokens (``marks``: the turns it then holds), or None when that would not be exactly the
        KV the session had there: a model with sliding-window layers (the answer pushed rows out
        of the window), a policy that drops rows while decoding or re-selects, tiers that quantize.
        Otherwise each full-attention layer appended one row per fed token of the answer after
        its prompt was compressed, so dropping those rows undoes exactly that."""
        engine = self.engine
        if any(t.kivi is not None for t in self.tiers.tiers) or len(engine.full_layers) != engine.attention_layers:
            return None
        with self.lock:  # held here at the entry's version, in a tier: else a replay costs less than a load
            held, policy = self._current(key, entry)
            if held is None or self.tiers.tier_of(key) is None or policy.reselects or engine.prunes_answers(policy):
                return None
        session, source = self.load(key, entry)
        cache = session.cache
        if source in ("rebuilt", "imported"):
            return None
        fed = session.logical_len - upto
        if fed < 0 or any(layer.kept_len < fed for layer in cache.layers):
            return None
        for layer in cache.layers:
            layer.values = layer.values[:, :, : layer.kept_len - fed]  # views: the held blob is never written
            layer.keys = layer.keys[:, :, : layer.kept_len - fed]
            layer.logical_len -= fed
        session.logical_len = upto
        session.transcript = session.transcript[:upto]
        session.marks = list(marks)
        session.turns = len(marks)
        return session

    def _restore(self, session, entry, blob: KVBlob, transcript, marks, full: KVBlob | None) -> None:
        session.cache = import_kv(self.engine.model.config, blob.tensors, blob.logical_len)
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
            with self.model_lock:
                self.engine.rebuild(session, transcript, entry.logical_len or len(transcript), marks)

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

    # -- writing -------------------------------------------------------------------------
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
            updated = _copy(entry)
            updated.owner, updated.epoch, updated.last_turn = self.worker_id, self.epoch, turn_id
            updated.logical_len, updated.kept_len = session.logical_len, session.kept_len
            updated.kv_bytes, updated.turns = session.kv_bytes, session.turns
            blob = KVBlob(export_kv(session.cache), session.logical_len, version=expected + 1)
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
            try:
                self.directory.register_conversation(entry.tenant, entry.conversation, entry.session_id, all_messages)
            except Exception as exc:  # noqa: BLE001 - the turn is committed already
                log.warning("conversation of %s not recorded: %s", key, exc)

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
        where LRU demotes or drops it like any other blob. It is kept at full precision
        (``exact``) even where the tiers quantize KV (kv_quant): re-selection scores its rows
        and copies them to the device every turn."""
        if session.full_kv is None:
            self.tiers.discard(_full_key(key))
            return
        tensors = [t for idx in sorted(session.full_kv) for t in session.full_kv[idx]]
        self.tiers.put(_full_key(key), KVBlob(tensors, session.full_len, version, exact=True), tier=1)

    def forget(self, key: str) -> None:
        """Drop this worker's KV and knowledge of a session (its log in Redis stays)."""
        with self.lock:
            self.tiers.discard(key)
            self.tiers.discard(_full_key(key))
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
                full = self.tiers.peek(_full_key(key))
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
            entry = _copy(held.entry)
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


def _copy(entry: SessionEntry) -> SessionEntry:
    return SessionEntry(**{f: getattr(entry, f) for f in entry.__slots__})


def _full_key(key: str) -> str:
    """Where a reselect session's full copy lives in the tiers ("/" never occurs in ids)."""
    return f"{key}/full"
