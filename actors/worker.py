"""A worker: one engine and its sessions (:class:`~.sessions.SessionStore`: tiered KV and the
Redis directory). Usable in-process (tests, benchmarks); the Ray Serve replica wraps one.

A turn, as :meth:`Worker.stream` runs it:

    lease = sessions.checkout(req)   # once: claim the session (a second concurrent turn: 409),
                                     # read its directory entry (Redis: version, lengths, policy),
                                     # load its KV (device -> host -> disk tier, a hand-over, else
                                     # replay the token log) or take it back to a turn boundary
    job   = the turn joins the worker's batch (engine/scheduler.py): prefill the new tokens,
            compress, decode together with the other sessions' turns (streamed)
    sessions.checkin(lease, messages)  # once: KV back into the device tier; compare-and-set the
                                     # entry (version + 1), append the turn's tokens, mark and
                                     # messages to the logs (None: drop what a broken turn did)

The scheduler thread owns the model while turns run; the request's own thread loads, waits
for its tokens and commits. A rebuild (model work outside any turn) takes the model lock
between two of the scheduler's steps.
"""

from __future__ import annotations

import logging
import threading

from kvsnap.engine.engine import Engine, TurnResult, TurnStream
from kvsnap.engine.models import dtype_name
from kvsnap.engine.sampling import SamplingParams
from kvsnap.engine.scheduler import Job, Scheduler
from kvsnap.engine.session import Session, TurnMark
from kvsnap.errors import Unavailable
from kvsnap.policies import Policy
from kvsnap.store.directory import SessionDirectory, SessionEntry
from kvsnap.store.tiers import TieredStore

from .held import Lease
from .sessions import SessionStore
from .turns import SessionSpec, TurnRequest

log = logging.getLogger(__name__)
DRAIN_WAIT_S = 60.0  # a drain waits this long for the turns in progress to end before handing sessions over


class Worker:
    def __init__(
        self,
        engine: Engine,
        directory: SessionDirectory,
        store: TieredStore,
        worker_id: str,
        *,
        max_batch: int = 16,
        step_tokens: int | None = None,
        threads: int | None = None,
    ):
        self.engine = engine
        self.sessions = SessionStore(engine, directory, store, worker_id)
        self.worker_id = self.sessions.worker_id
        self.directory, self.store, self.counters = directory, store, self.sessions.counters
        self._model = threading.RLock()  # the model: held by the scheduler for each step and each rebuild
        self.scheduler = Scheduler(engine, self._model, max_batch=max_batch, step_tokens=step_tokens, threads=threads)
        self.sessions.replay = self._replay  # a lost session's turns replayed in the batch
        self._stop = threading.Event()
        self._resume: threading.Timer | None = None  # ends a drain (see drain)
        try:
            self.heartbeat()
        except Unavailable:
            log.warning("worker %s: Redis unreachable at start; will retry on heartbeat", worker_id)

    @property
    def held(self):
        return self.sessions.held

    @property
    def epoch(self) -> int:
        return self.sessions.epoch

    @property
    def draining(self) -> bool:
        """Set by a drain: turns on held sessions are refused (they move), until it ends."""
        return self.sessions.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.sessions.draining = value

    # -- turns ---------------------------------------------------------------------------
    def stream(self, req: TurnRequest) -> TurnStream:
        """Start ``req``: checked, claimed and loaded now (errors raise here, before any model
        work on a bad request); tokens come as the stream is iterated. The stream holds the
        session's claim until it ends or is closed; it commits what was generated either way."""
        fresh = self._new(req) if req.new_session is not None else None
        with self.sessions.checkout(req, fresh) as lease:  # a rebuild runs in the batch meanwhile
            turn = self.engine.start(lease.session, self._unmarked(req, lease.session), req.sampling)
        job = self.scheduler.job(turn)  # submitted when the stream is first iterated
        out = TurnStream(source=lease.source, on_close=lease.claim.release, detok=job, cancel=job.cancel)
        out.tokens = self._run(req, lease, job, out)
        return out

    def run(self, req: TurnRequest) -> TurnResult:
        """:meth:`stream`, collected."""
        stream = self.stream(req)
        tokens = list(stream)
        return TurnResult(tokens, self.engine.decode(tokens), stream.finish_reason, stream.report, stream.source)

    def open(
        self,
        tenant: str,
        session_id: str,
        tokens: list[int],
        policy: Policy,
        recompress: str = "per_turn",
        sampling: SamplingParams | None = None,
        **logged,
    ) -> TurnResult:
        """Open a session with its first tokens (a document), optionally generating an answer.
        ``logged``: ``log`` (messages) and ``answer_role``, as in :class:`TurnRequest`."""
        spec = SessionSpec(policy, recompress)
        return self.run(TurnRequest(tenant, session_id, tokens, sampling, spec, **logged))

    def turn(self, tenant: str, session_id: str, tokens: list[int], sampling: SamplingParams, **logged) -> TurnResult:
        return self.run(TurnRequest(tenant, session_id, tokens, sampling, **logged))

    def hold_prefix(self, tenant: str, tokens: list[int]) -> int:
        """Prefill the whole prefill chunks of ``tokens`` (a registered document's, one token left
        over for a session's own first query) into the tenant's shared prefixes, through the batch
        like any turn, on a session nobody holds; returns the tokens now shared (0: no prefix cache)."""
        prefixes = self.engine.prefixes
        if prefixes is None:
            return 0
        n = (len(tokens) - 1) // prefixes.block * prefixes.block
        if n and prefixes.known(tenant, tokens[:n]) < n:
            session = self.engine.new_session("full", "never")
            session.prefix_scope = tenant
            job = self.scheduler.submit(self.engine.start(session, tokens[:n], None))
            for _ in job:  # raises the turn's error, if any
                pass
            self.publish_prefixes()  # at once, not at the next heartbeat (a hint: never raises)
        return prefixes.known(tenant, tokens[:n])

    def _replay(self, session: Session, transcript: list[int], logical_len: int, marks: list[TurnMark]) -> None:
        """Rebuild a lost session from its log in the batch: its replay (engine/replay.py) goes on
        a chunk a step beside the running turns, which keep decoding meanwhile. A log without
        turn marks (one pass), or a call from the scheduler's own thread, rebuilds between steps."""
        replay = None if self.scheduler.inline else self.engine.replaying(session, transcript, logical_len, marks)
        if replay is None:
            self.scheduler.call(self.engine.rebuild, session, transcript, logical_len, marks)
            return
        for _ in self.scheduler.submit(replay):  # no tokens: raises the replay's error, if any
            pass

    def _new(self, req: TurnRequest) -> Session:
        session = self.engine.new_session(req.new_session.policy, req.new_session.recompress, req.session_id)
        session.prefix_scope = req.tenant  # its first turn may start from the tenant's shared prefixes
        self.engine.check(session, req.tokens, req.sampling)  # a bad request writes nothing
        return session

    def _unmarked(self, req: TurnRequest, session: Session) -> list[int]:
        """``req.tokens`` without their leading turn marker when the session holds it already: its
        last answer stopped on that marker (as a stop string) and ends with its very tokens."""
        n, marker = len(req.marker), req.marker
        if not n or len(req.tokens) <= n or req.tokens[:n] != marker or session.transcript[-n:] != marker:
            return req.tokens
        last = session.marks[-1] if session.marks else None
        if last is None or last.stopped_on != self.engine.decode(marker):
            return req.tokens
        return req.tokens[n:]

    def _run(self, req: TurnRequest, lease: Lease, job: Job, out: TurnStream):
        """The turn's tokens as the scheduler makes them; commits when it ends (also when closed early)."""
        with lease.claim:
            self.scheduler.submit(job)
            try:
                yield from job
            except GeneratorExit:  # the client went away: keep what was generated
                job.cancel()
                job.wait()
                self._settle(req, lease, job, out)
                raise
            except BaseException:  # the turn broke half way: its KV is not trusted, the log is
                job.cancel()
                job.wait()
                self.sessions.checkin(lease, None)
                raise
            self._settle(req, lease, job, out)

    def _settle(self, req: TurnRequest, lease: Lease, job: Job, out: TurnStream) -> None:
        """Hand the session back with what the turn did. One cancelled before it left the queue
        changed nothing (a new session it was to open is not kept; a session it was to take
        back stays as it was)."""
        if job.error is not None:
            self.sessions.checkin(lease, None)
        elif job.turn.prefill is not None:
            out.finish_reason, out.report = job.turn.finish_reason, job.turn.report
            out.report.replayed_tokens = lease.replayed
            messages = list(req.log)
            if req.answer_role:  # logged as the caller got it: cut at its stop string
                messages.append({"role": req.answer_role, "content": job.text})
            self.sessions.checkin(lease, messages, req.turn_id)
        elif lease.source == "new":
            self.sessions.checkin(lease, None)

    # -- sessions ------------------------------------------------------------------------
    def messages(self, tenant: str, session_id: str) -> list[dict]:
        return self.sessions.messages(tenant, session_id)

    def state(self, tenant: str, session_id: str) -> SessionEntry:
        return self.sessions.entry(tenant, session_id)

    def delete(self, tenant: str, session_id: str) -> None:
        self.sessions.delete(tenant, session_id)

    # -- liveness and drains -------------------------------------------------------------
    def heartbeat(self) -> None:
        """Refresh this worker's heartbeat; re-register held sessions Redis lost or missed;
        report the shared prefixes held (store/prefix_holders.py)."""
        try:
            self.sessions.heartbeat(load=self.stats)
        finally:  # reported even when the rest of the heartbeat failed
            self.publish_prefixes()

    def publish_prefixes(self) -> None:
        """Tell the directory which shared prefixes this worker holds (the router reads it). A
        hint: a failure is logged (Redis down: quietly), never raised; the next heartbeat retries."""
        if self.engine.prefixes is None:
            return
        try:
            self.sessions.directory.publish_prefixes(self.worker_id, self.engine.prefixes.roots())
        except Unavailable:
            pass
        except Exception:
            log.exception("worker %s: reporting its shared prefixes failed", self.worker_id)

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
        self.scheduler.stop()

    def drain(self, resume_after_s: float | None = None) -> int:
        """Stop taking turns and hand every held session's KV over (:meth:`SessionStore.export_all`).

        A drain ends: after ``resume_after_s`` seconds (None: never; the replica is on its way
        out, e.g. its spot node is reclaimed) the worker takes turns and new sessions again.
        Meanwhile the router places the handed-over sessions elsewhere; a session whose next turn
        comes back here later imports its own hand-over."""
        self.draining = True
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if not self.sessions.wait_idle(DRAIN_WAIT_S):  # the turns in progress end and commit first
            log.warning(
                "worker %s: turns still running after %.0f s of drain; exporting anyway", self.worker_id, DRAIN_WAIT_S
            )
        exported = self.sessions.export_all()
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

    def stats(self) -> dict:
        return {
            "worker": self.worker_id,
            "epoch": self.epoch,
            "device": str(self.engine.loaded.device),
            "dtype": dtype_name(self.engine.loaded.dtype),
            "draining": self.draining,
            **self.sessions.stats(),
            "batch": self.scheduler.load,
            "prefixes": self.engine.prefixes.stats() if self.engine.prefixes is not None else {},
        }


__all__ = ["Worker"]
