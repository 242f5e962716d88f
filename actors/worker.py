"""A worker: one engine, its tiered session-KV store, and the Redis session directory.

Usable in-process (tests, benchmarks); the Ray Serve replica wraps one. A turn:

    entry   = directory entry of (tenant, session)          # Redis: version, lengths, policy
    session = load KV: device -> host -> disk tier, else rebuild from the token log
    stream  = engine: prefill the new tokens, compress, decode (streamed)
    store   = KV back into the device tier (LRU demotion below)
    commit  = compare-and-set the entry (version + 1) and append the turn's tokens to the log

Redis is a hint, the worker is the truth: KV is only reused when its version is
the directory's version; anything else is rebuilt from the token log, so nothing is
lost while the log survives. While Redis is down, turns on sessions this worker
holds still run (their commits are replayed when Redis returns); others fail with
``Unavailable``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from kvsnap.errors import Conflict, NotFound, Unavailable
from kvsnap.policies import Policy, policy_from_json, policy_to_json

from .cache import export_kv, full_layer_indices, import_kv
from .directory import SessionDirectory, SessionEntry, check_id
from .engine import Engine, TurnResult, TurnStream
from .sampling import SamplingParams, cut_at_stop
from .session import Session, TurnMark
from .tiers import KVBlob, TieredStore, blob_from_bytes, blob_to_bytes

log = logging.getLogger(__name__)


class TurnRecord(NamedTuple):
    """What a turn writes besides its tokens: messages for the message log, the role its answer
    is logged under (None: not logged), the caller's id for the turn (stored as the entry's
    ``last_turn``, so a caller whose answer was lost can tell whether the turn was applied), and
    the stop strings the answer's logged text is cut at (the text the caller got back)."""

    messages: list[dict]
    answer_role: str | None
    turn_id: str = ""
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class Held:
    """What this worker knows of a session it holds (the KV itself is in the tiers)."""

    entry: SessionEntry  # as last committed (or to be replayed, when ``dirty``)
    transcript: list[int]
    messages: list[dict]  # the message log (HTTP / OpenAI APIs), for re-registration
    marks: list[TurnMark] = field(default_factory=list)  # each turn's place in the transcript (replays)
    dirty: bool = False  # committed locally while Redis was unreachable


class Worker:
    def __init__(self, engine: Engine, directory: SessionDirectory, store: TieredStore, worker_id: str):
        self.engine = engine
        self.directory = directory
        self.store = store
        self.worker_id = check_id("worker id", worker_id)
        self.epoch = time.time_ns()  # incarnation: a restarted worker never reuses one
        self.held: dict[str, Held] = {}
        self.counters: Counter = Counter()  # rebuilds, tier hits, offline turns, resyncs, conflicts
        self._busy: dict[str, _Claim] = {}  # sessions with a turn in progress
        self._busy_lock = threading.Lock()
        self._lock = threading.RLock()  # one model: turns run one at a time
        self._stop = threading.Event()
        self.draining = False
        self._resume: threading.Timer | None = None  # ends a drain (see drain)
        try:
            self.heartbeat()
        except Unavailable:
            log.warning("worker %s: Redis unreachable at start; will retry on heartbeat", worker_id)

    # -- public operations ---------------------------------------------------------------
    def open(
        self,
        tenant: str,
        session_id: str,
        tokens: list[int],
        policy: Policy,
        recompress: str = "per_turn",
        sampling: SamplingParams | None = None,
        **msglog,
    ) -> TurnResult:
        """Create a session from its first tokens (a document), optionally generating an answer."""
        return self._collect(self.open_stream(tenant, session_id, tokens, policy, recompress, sampling, **msglog))

    def turn(self, tenant: str, session_id: str, tokens: list[int], sampling: SamplingParams, **msglog) -> TurnResult:
        return self._collect(self.turn_stream(tenant, session_id, tokens, sampling, **msglog))

    def open_stream(
        self,
        tenant: str,
        session_id: str,
        tokens: list[int],
        policy: Policy,
        recompress: str = "per_turn",
        sampling: SamplingParams | None = None,
        log_messages: list[dict] | None = None,
        answer_role: str | None = None,
    ) -> TurnStream:
        """``log_messages`` are appended to the session's message log with the turn, followed by
        ``{"role": answer_role, "content": <the generated text>}`` when ``answer_role`` is set."""
        key = self._key(tenant, session_id)
        session = self.engine.new_session(policy, recompress, session_id)
        entry = SessionEntry(
            tenant,
            session_id,
            policy=policy_to_json(policy),
            policy_fingerprint=policy.fingerprint(),
            model=self.engine.loaded.fingerprint,
            recompress=recompress,
        )
        stream = self.engine.stream(session, tokens, sampling)  # validates before any work or write
        with self._claimed(key) as claim:
            if self.directory.get(tenant, session_id) is not None:
                raise Conflict(f"session {session_id!r} already exists")
            self.directory.create(entry, [])  # version 1, empty log: the first commit carries the tokens
        stop = sampling.stop if sampling is not None else ()
        return self._wrap(claim, entry, session, stream, "new", TurnRecord(log_messages or [], answer_role, "", stop))

    def turn_stream(
        self,
        tenant: str,
        session_id: str,
        tokens: list[int],
        sampling: SamplingParams,
        log_messages: list[dict] | None = None,
        answer_role: str | None = None,
        turn_id: str = "",
    ) -> TurnStream:
        """``turn_id`` (the caller's, optional) is stored with the commit as the entry's ``last_turn``."""
        key = self._key(tenant, session_id)
        with self._claimed(key) as claim:  # held until the stream ends: a second turn gets Conflict
            if self.draining:
                raise Unavailable("worker is draining; retry (the session moves to another worker)")
            entry = self._entry(tenant, session_id, key)
            session, source = self._load(key, entry)
            stream = self.engine.stream(session, tokens, sampling)
        record = TurnRecord(log_messages or [], answer_role, turn_id, sampling.stop)
        return self._wrap(claim, entry, session, stream, source, record)

    def messages(self, tenant: str, session_id: str) -> list[dict]:
        """The session's message log; this worker's copy while Redis is down."""
        key = self._key(tenant, session_id)
        try:
            return self.directory.messages(tenant, session_id)
        except Unavailable:
            if key in self.held:
                return list(self.held[key].messages)
            raise

    def state(self, tenant: str, session_id: str) -> SessionEntry:
        key = self._key(tenant, session_id)
        return self._entry(tenant, session_id, key)

    def delete(self, tenant: str, session_id: str) -> None:
        key = self._key(tenant, session_id)
        with self._claimed(key) as claim, claim:
            existed = self.directory.delete(tenant, session_id)
            with self._lock:
                self._discard(key)
                held = self.held.pop(key, None)
        if not existed and held is None:
            raise NotFound(f"session {session_id!r} not found")

    # -- liveness and re-registration ----------------------------------------------------
    def heartbeat(self) -> None:
        """Refresh this worker's heartbeat; re-register held sessions Redis lost or missed."""
        alive = self.directory.worker_alive(self.worker_id, self.epoch)
        self.directory.heartbeat(self.worker_id, self.epoch)
        self.directory.publish_load(self.worker_id, self.stats())
        self._expire_idle()
        with self._lock:
            todo = [k for k, h in self.held.items() if h.dirty or not alive]
        for key in todo:
            self._resync(key)

    def start_heartbeat(self, interval_s: float = 2.0) -> threading.Thread:
        def loop():
            while not self._stop.wait(interval_s):
                try:
                    self.heartbeat()
                except Unavailable:
                    pass
                except Exception:  # keep beating whatever happens to one round
                    log.exception("heartbeat failed")

        thread = threading.Thread(target=loop, name=f"kvsnap-heartbeat-{self.worker_id}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def drain(self, resume_after_s: float | None = None) -> int:
        """Stop taking turns and hand every held session's KV over through Redis, so the
        replicas that get these sessions next import the KV instead of re-prefilling.
        Returns how many sessions were exported.

        A drain ends: after ``resume_after_s`` seconds (None: never; the replica is on its way
        out, e.g. its spot node is reclaimed) the worker takes turns and new sessions again.
        Meanwhile the router places the handed-over sessions elsewhere; a session whose next turn
        comes back here later imports its own hand-over."""
        self.draining = True
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        exported = 0
        with self._lock:
            for key, held in list(self.held.items()):
                blob = self.store.get(key)
                if blob is None or blob.version != held.entry.version or held.dirty:
                    continue  # nothing trustworthy to hand over: the next worker rebuilds from the log
                full = self.store.peek(_full_key(key))
                try:
                    self.directory.put_export(held.entry.tenant, held.entry.session_id, blob_to_bytes(blob))
                    if full is not None and full.version == blob.version:  # reselect: its full copy goes too
                        data = blob_to_bytes(full)
                        self.directory.put_export(held.entry.tenant, held.entry.session_id, data, part="full")
                    exported += 1
                except Unavailable:
                    break
                self._discard(key)
                self.held.pop(key)
        self.counters["exported"] += exported
        log.info("worker %s drained: %d sessions exported", self.worker_id, exported)
        if resume_after_s is not None:
            self._resume = threading.Timer(resume_after_s, self._end_drain)
            self._resume.daemon = True
            self._resume.start()
        return exported

    def _end_drain(self) -> None:
        self.draining = False
        self._resume = None
        log.info("worker %s: drain over, taking sessions again", self.worker_id)

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

    # -- the steps -----------------------------------------------------------------------
    def _entry(self, tenant: str, session_id: str, key: str) -> SessionEntry:
        """The directory entry; while Redis is down, this worker's own copy of a session it holds."""
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
            return _copy(held.entry)  # our offline turns are newer than Redis: replayed on commit
        return entry

    def _load(self, key: str, entry: SessionEntry) -> tuple[Session, str]:
        """The session's KV from the tiers when it is the directory's version, else rebuilt."""
        with self._lock:
            held = self.held.get(key)
            tier = self.store.tier_of(key)
            blob = self.store.get(key) if held and held.entry.version == entry.version else None
            policy = policy_from_json(entry.policy)
            session = self.engine.new_session(policy, entry.recompress, entry.session_id)
            if blob is not None and blob.version == entry.version:
                session.cache = import_kv(self.engine.model.config, blob.tensors, blob.logical_len)
                session.logical_len = blob.logical_len
                session.transcript = list(held.transcript)
                session.marks = list(held.marks)
                session.turns = entry.turns
                if entry.recompress == "reselect":
                    self._attach_full_copy(entry, session, self.store.peek(_full_key(key)))
                self.counters[f"hit_{tier}"] += 1
                return session, tier
            if entry.owner and entry.owner != self.worker_id:
                self.counters["moves_in"] += 1
                log.info("session %s moves from worker %s to %s", key, entry.owner, self.worker_id)
            imported = self._import(entry)
            if imported is not None:
                session.cache = import_kv(self.engine.model.config, imported.tensors, imported.logical_len)
                session.logical_len = imported.logical_len
                session.transcript = self.directory.tokens(entry.tenant, entry.session_id)
                session.marks = self.directory.marks(entry.tenant, entry.session_id)
                session.turns = entry.turns
                if entry.recompress == "reselect":
                    self._attach_full_copy(entry, session, self._import(entry, part="full"))
                self.counters["imports"] += 1
                return session, "imported"
            if held and held.entry.version == entry.version:
                transcript, marks = held.transcript, held.marks
            else:
                transcript = self.directory.tokens(entry.tenant, entry.session_id)
                marks = self.directory.marks(entry.tenant, entry.session_id)
            if len(transcript) != entry.log_len:
                raise Unavailable(
                    f"token log of {entry.session_id!r} has {len(transcript)} tokens, expected {entry.log_len}; retry"
                )
            if transcript:  # replays each turn as it ran (see Engine.rebuild)
                self.engine.rebuild(session, transcript, entry.logical_len or len(transcript), marks)
            session.turns = entry.turns
            self.counters["rebuilds"] += 1
            return session, "rebuilt"

    def _wrap(
        self,
        claim: _Claim,
        entry: SessionEntry,
        session: Session,
        stream: TurnStream,
        source: str,
        record: TurnRecord,
    ) -> TurnStream:
        """Run ``stream`` under the worker lock and commit when it ends (also when closed early).
        The session's claim passes to the stream: released when it ends or is closed."""
        out = TurnStream(finish_reason=stream.finish_reason, source=source, on_close=claim.release)
        out.tokens = self._run(claim, entry, session, stream, out, record)
        return out

    def _run(
        self,
        claim: _Claim,
        entry: SessionEntry,
        session: Session,
        stream: TurnStream,
        out: TurnStream,
        record: TurnRecord,
    ) -> Iterator[int]:
        key = claim.key
        with claim, self._lock:
            try:
                yield from stream
            except GeneratorExit:  # the client went away: keep what was generated
                self._finish(key, entry, session, stream, out, record)
                raise
            except BaseException:  # the turn broke half way: its KV is not trusted, the log is
                self._discard(key)
                self.held.pop(key, None)
                if out.source == "new":
                    self.directory.delete(entry.tenant, entry.session_id)
                raise
            self._finish(key, entry, session, stream, out, record)

    def _finish(
        self,
        key: str,
        entry: SessionEntry,
        session: Session,
        stream: TurnStream,
        out: TurnStream,
        record: TurnRecord,
    ) -> None:
        out.finish_reason, out.report = stream.finish_reason, stream.report
        messages, answer_role = record.messages, record.answer_role
        if answer_role:
            generated = session.transcript[len(session.transcript) - out.report.generated_tokens :]
            text = cut_at_stop(self.engine.decode(generated), record.stop)
            messages = [*messages, {"role": answer_role, "content": text}]
        self._commit(key, entry, session, messages, record.turn_id)

    def _commit(self, key: str, entry: SessionEntry, session: Session, messages: list[dict], turn_id: str = "") -> None:
        expected = entry.version
        logged = entry.log_len
        updated = _copy(entry)
        updated.owner, updated.epoch, updated.last_turn = self.worker_id, self.epoch, turn_id
        updated.logical_len, updated.kept_len = session.logical_len, session.kept_len
        updated.kv_bytes, updated.turns = session.kv_bytes, session.turns
        blob = KVBlob(export_kv(session.cache), session.logical_len, version=expected + 1)
        updated.tier = self.store.put(key, blob) or "dropped"
        self._store_full_copy(key, session, expected + 1)
        held = self.held.get(key)
        all_messages = (held.messages if held and held.entry.version == expected else []) + messages
        try:  # one commit per turn: its mark is the session's last
            self.directory.commit(updated, expected, session.transcript[logged:], messages, session.marks[-1:])
        except Conflict:
            self._discard(key)
            self.held.pop(key, None)
            self.counters["conflicts"] += 1
            raise
        except Unavailable:
            updated.version = expected + 1
            updated.log_len = len(session.transcript)
            self.held[key] = Held(updated, list(session.transcript), all_messages, list(session.marks), dirty=True)
            log.warning("commit of %s deferred: Redis unavailable", key)
            return
        self.held[key] = Held(updated, list(session.transcript), all_messages, list(session.marks))
        self._record_moves()

    def _store_full_copy(self, key: str, session: Session, version: int) -> None:
        """recompress="reselect": the full copy goes to the host tier (never the device tier),
        where LRU demotes or drops it like any other blob. It is kept at full precision
        (``exact``) even where the tiers quantize KV (kv_quant): re-selection scores its rows
        and copies them to the device every turn."""
        if session.full_kv is None:
            self.store.discard(_full_key(key))
            return
        tensors = [t for idx in sorted(session.full_kv) for t in session.full_kv[idx]]
        self.store.put(_full_key(key), KVBlob(tensors, session.full_len, version, exact=True), tier=1)

    def _attach_full_copy(self, entry: SessionEntry, session: Session, blob: KVBlob | None) -> None:
        """Give a reselect session its full copy back (from a tier, or handed over by a drained
        worker) when it is current; without one the session goes on as plain SnapKV."""
        if blob is None or blob.version != entry.version:
            self.counters["reselect_fallbacks"] += 1
            return
        layers = full_layer_indices(session.cache)
        session.full_kv = {idx: (blob.tensors[2 * n], blob.tensors[2 * n + 1]) for n, idx in enumerate(layers)}
        session.full_len = blob.logical_len

    def _record_moves(self) -> None:
        """Tell the directory where demotions left other sessions' KV (best effort: a stale tier
        only misreports the state; a turn still finds the KV in whatever tier it is)."""
        for key, tier in self.store.take_moves().items():
            held = self.held.get(key)  # None for full copies (".../full"): not in the directory
            if held is None:
                continue
            held.entry.tier = tier
            try:
                self.directory.set_tier(held.entry.tenant, held.entry.session_id, self.worker_id, self.epoch, tier)
            except Unavailable:
                log.info("tier of %s not recorded: Redis unavailable", key)

    def _resync(self, key: str) -> None:
        with self._lock:
            held = self.held.get(key)
            if held is None:
                return
            entry = _copy(held.entry)
            entry.tier = self.store.tier_of(key) or "dropped"
            if self.directory.restore(entry, held.transcript, held.messages, held.marks):
                self.counters["resyncs"] += 1
            held.dirty = False

    def _expire_idle(self) -> None:
        """Forget sessions idle past the directory TTL (Redis expired them too)."""
        cutoff = time.time() - self.directory.session_ttl_s
        with self._lock:
            for key in [k for k, h in self.held.items() if h.entry.last_used < cutoff and not h.dirty]:
                self.held.pop(key)
                self._discard(key)

    # -- helpers -------------------------------------------------------------------------
    def _discard(self, key: str) -> None:
        self.store.discard(key)
        self.store.discard(_full_key(key))

    @staticmethod
    def _key(tenant: str, session_id: str) -> str:
        return f"{check_id('tenant', tenant)}/{check_id('session id', session_id)}"

    @contextmanager
    def _claimed(self, key: str):
        """Claim ``key`` (one turn per session at a time: a second concurrent one gets Conflict,
        HTTP 409, before any model work). Released on an error; on success the caller keeps the
        claim (a stream releases it when it ends) or releases it."""
        with self._busy_lock:
            if key in self._busy:
                raise Conflict("another turn on this session is in progress")
            claim = _Claim(key, self)
            self._busy[key] = claim
        try:
            yield claim
        except BaseException:
            claim.release()
            raise

    def _collect(self, stream: TurnStream) -> TurnResult:
        tokens = list(stream)
        return TurnResult(tokens, self.engine.decode(tokens), stream.finish_reason, stream.report, stream.source)

    def stats(self) -> dict:
        return {
            "worker": self.worker_id,
            "epoch": self.epoch,
            "held": len(self.held),
            "draining": self.draining,
            "bytes_by_tier": self.store.bytes_by_tier(),
            "sessions_by_tier": self.store.sessions_by_tier(),
            "demotions": dict(self.store.stats.demotions),
            "promotions": dict(self.store.stats.promotions),
            "dropped": self.store.stats.dropped,
            "corrupt": self.store.stats.corrupt,
            **self.counters,
        }


class _Claim:
    """One turn's hold on a session; ``release`` is idempotent and never frees a later turn's claim.
    As a context manager it releases on exit."""

    __slots__ = ("key", "worker")

    def __init__(self, key: str, worker: Worker):
        self.key, self.worker = key, worker

    def release(self) -> None:
        with self.worker._busy_lock:
            if self.worker._busy.get(self.key) is self:
                del self.worker._busy[self.key]

    def __enter__(self) -> _Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _copy(entry: SessionEntry) -> SessionEntry:
    return SessionEntry(**{f: getattr(entry, f) for f in entry.__slots__})


__all__ = ["Held", "Worker"]


def _full_key(key: str) -> str:
    """Where a reselect session's full copy lives in the tiers ("/" never occurs in ids)."""
    return f"{key}/full"
