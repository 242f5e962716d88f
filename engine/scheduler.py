"""Continuous batching: one thread owns the model and runs many sessions' turns step by step.

Each step (nano-vllm / vLLM style iteration-level scheduling):

    admit    waiting turns join the batch while fewer than ``max_batch`` run (first come, first in)
    rows     the next prompt chunk of turns still prefilling, oldest first, while the step's token
             budget lasts (at least one chunk a step), and every decoding turn's pending token
    forward  one packed forward over all the rows, each on its own session's cache
             (:meth:`Engine.step`, engine/batch.py): a long document holds the running sessions
             up for one chunk per step, never for its whole prompt, and short prompts (follow-up
             questions) ride in the same forward as the decode rows, not in one of their own
    sample   each turn samples from its own row
    hand out each new token (and its text) goes to the turn's consumer; turns that ended leave
    settle   a prompt that ended in this step is compressed in the next step's ``rows`` (or as
             its turn ends): its first token is out before the compression runs; when that
             next step has prompt chunks, it waits one step more (its second token with it), so
             that the prompts that arrived meanwhile get their first tokens first

A turn's chunks are cut the same way alone and in a batch (every ``chunk`` tokens from its
prompt's start), and every row is computed from its own session only, so a session's tokens
are the tokens it would get alone. Errors stay with their turn: one whose sampling or stop
check fails ends alone with its error; a failed batched forward fails the turns in it (their
caches may be half-updated: the worker forgets them and rebuilds from the log). A cancelled
turn (client gone) leaves at the next step boundary; one still prefilling finishes its prompt
first, so that its mark in the log describes a whole prompt.

Consumers (request threads) block on a :class:`Job`; nothing they do touches the model. A
rebuild is a job too: a lost session's logged turns replayed (engine/replay.py, no tokens out).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future

from kvsnap.errors import Unavailable

from .replay import Replaying
from .threads import own_threads
from .turn import Turn

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # histogram of decode rows per step
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)  # histogram of tokens run per step
_END = object()


class Job:
    """A turn handed to the scheduler, as its consumer sees it: iterate for the tokens (the
    turn's error, if it failed, is raised at the end); ``take`` gives the text that came with
    the tokens iterated so far; ``cancel`` stops it at the next step."""

    def __init__(self, turn: Turn, scheduler: Scheduler):
        self.turn = turn
        self.scheduler = scheduler
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.queue_s = 0.0  # waiting to join the batch
        self.held = False  # its prompt's compression waited a step for other prompts (once at most)
        self.ended = threading.Event()
        self.cancelled = threading.Event()
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (token, text delta) | (_END, final delta)
        self._text: list[str] = []

    def __iter__(self) -> Iterator[int]:
        while True:
            token, delta = self._events.get()
            self._text.append(delta)
            if token is _END:
                if self.error is not None:
                    raise self.error
                return
            yield token

    def take(self, final: bool = False) -> str:
        """Text of the tokens iterated so far, not handed out yet (``final``: the turn is over)."""
        if final:
            self.ended.wait()
        delta, self._text = "".join(self._text), []
        return delta

    @property
    def text(self) -> str:
        """The answer's text (up to the first stop string), once the turn is over."""
        return self.turn.detok.text if self.turn.detok is not None else ""

    def cancel(self) -> None:
        self.cancelled.set()
        self.scheduler.wake()

    def wait(self, timeout: float | None = None) -> bool:
        return self.ended.wait(timeout)


class Scheduler:
    def __init__(
        self,
        engine,
        lock: threading.RLock,
        max_batch: int = 16,
        step_tokens: int | None = None,
        *,
        start: bool = True,
        threads: int | None = None,
    ):
        """``start=False``: no thread; the caller runs the steps (:meth:`run_step`, for tests).
        ``threads``: the torch (OpenMP) threads of the scheduler thread's steps, and one for
        threads that start torch work after it (engine/threads.py); None leaves torch as it is."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.threads = threads
        self.lock = lock  # the model's: other model work (a rebuild of an old log) runs between steps
        self.max_batch = max_batch
        self.chunk = engine.prefill_chunk
        self.step_tokens = max(step_tokens or engine.prefill_chunk, 1)  # prompt tokens per step (budget)
        self.stats: Counter = Counter()  # steps, tokens, rows, turns; histogram buckets (batch_le_*, tokens_le_*)
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._calls: list[tuple] = []  # (fn, args, future): see call
        self._thread = threading.Thread(target=self._loop, name="kvsnap-scheduler", daemon=True) if start else None
        if self._thread is not None:
            self._thread.start()

    # -- consumers -----------------------------------------------------------------------
    def job(self, turn: Turn) -> Job:
        """A job for ``turn``, not yet submitted (nothing runs before :meth:`submit`)."""
        return Job(turn, self)

    def submit(self, job: Job | Turn) -> Job:
        """Queue a job (or a turn) for the batch; it joins at the next step with room."""
        job = job if isinstance(job, Job) else Job(job, self)
        job.submitted = time.perf_counter()
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler stopped")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    @property
    def alive(self) -> bool:
        """The scheduler thread runs (always True for one driven by :meth:`run_step`)."""
        return self._thread is None or self._thread.is_alive()

    @property
    def load(self) -> dict:
        return {"running": len(self._running), "waiting": len(self._waiting), **self.stats}

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads:
            own_threads(self.threads)
        while True:
            with self._cv:
                while not self._stopped and not self._waiting and not self._running and not self._calls:
                    self._cv.wait()
                if self._stopped:
                    break
                calls, self._calls = self._calls, []
                self._admit()
            for fn, args, done in calls:  # model work outside any turn, between steps
                try:
                    with self.lock:
                        done.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - raised in the caller
                    done.set_exception(exc)
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - never leave a consumer waiting
                log.exception("scheduler step failed")
                for job in list(self._running):
                    self._fail(job, exc)
        for job in list(self._running) + list(self._waiting):
            self._fail(job, RuntimeError("scheduler stopped"))
        with self._cv:
            calls, self._calls = self._calls, []
        for _, _, done in calls:
            done.set_exception(Unavailable("the worker's scheduler stopped; retry"))

    def call(self, fn, *args):
        """``fn(*args)`` on the scheduler thread between steps, holding the model's lock, and its
        result: model work outside any turn (a rebuild) runs on the steps' OpenMP team (see
        :func:`.threads.own_threads`). Inline for a scheduler without a thread, or on its own thread."""
        if self.inline:
            with self.lock:
                return fn(*args)
        done: Future = Future()
        with self._cv:
            if self._stopped or not self.alive:
                raise Unavailable("the worker's scheduler is not running; retry")
            self._calls.append((fn, args, done))
            self._cv.notify()
        while True:
            try:
                return done.result(timeout=1.0)
            except TimeoutError:
                if not self.alive:
                    raise Unavailable("the worker's scheduler stopped; retry") from None

    @property
    def inline(self) -> bool:  # work handed to it runs in the caller: no thread, or on it
        return self._thread is None or threading.current_thread() is self._thread

    def run_step(self) -> bool:
        """One step, run by the caller (a scheduler made with ``start=False``); False when idle."""
        with self._cv:
            self._admit()
        if not self._running:
            return False
        self._step()
        return True

    def _admit(self) -> None:
        for job in [j for j in self._waiting if j.cancelled.is_set()]:  # gone before they started
            self._waiting.remove(job)
            self._leave(job, "")
        while self._waiting and len(self._running) < self.max_batch:
            job = self._waiting.popleft()
            job.queue_s = time.perf_counter() - job.submitted
            self._running.append(job)

    def _step(self) -> None:
        for job in [j for j in self._running if j.cancelled.is_set()]:
            if job.turn.prefill is None or not job.turn.prefilling:  # mid-prompt: it finishes the prompt first
                self._end(job)
        with self.lock:
            rows, owners = self._rows()
            if not rows:
                return
            t0 = time.perf_counter()
            try:
                logits = self.engine.step(rows)
            except Exception as exc:  # noqa: BLE001 - those caches are not trusted any more
                log.exception("a batch step of %d rows failed", len(rows))
                for job, _ in owners:
                    self._fail(job, Unavailable(f"the worker's batch step failed ({exc!r}); retry the turn"))
                return
            elapsed = time.perf_counter() - t0
            for b, (job, prefilling) in enumerate(owners):
                if prefilling:
                    self._run(job, job.turn.prefill_done, rows[b], logits[b], elapsed)
                else:
                    self._run(job, self._decoded, job, rows[b], logits[b])
        self._count(sum(not p for _, p in owners), sum(len(r.tokens) for r in rows))

    def _rows(self) -> tuple[list, list]:
        """This step's rows: prompt chunks of prefilling turns, oldest first, as long as they fit
        the budget (the oldest always does), then every decoding turn's pending token."""
        rows, owners, budget = [], [], 0
        for job in [j for j in self._running if j.turn.prefilling]:
            if (n := self._call(job, job.turn.next_chunk, self.chunk)) is None:
                continue  # it failed to start
            if budget and budget + n > self.step_tokens:
                continue  # a shorter prompt behind it may still fit
            budget += n
            if (row := self._call(job, job.turn.prefill_row, self.chunk)) is not None:
                rows.append(row)
                owners.append((job, True))
        prompts = bool(rows)
        for job in [j for j in self._running if j.turn.decoding and not j.cancelled.is_set()]:
            if prompts and job.turn.unsettled and not job.held:
                job.held = True  # its compression and second token wait a step: these prompts' first tokens go first
                continue
            if (row := self._call(job, self._decode_row, job.turn)) is not None:
                rows.append(row)
                owners.append((job, False))
        return rows, owners

    def _decode_row(self, turn: Turn):
        """``turn``'s next decode row, after its prompt's compression (which runs here, a step
        after its first token went out, when that step sampled it)."""
        turn.settle()
        return self.engine.decode_row(turn.session, turn.greedy)

    def _decoded(self, job: Job, row, logits) -> int | None:
        self.engine.after_decode(row)
        return job.turn.accept(logits)

    def _call(self, job: Job, fn, *args):
        """``fn(*args)`` for ``job``; an error ends that job alone (None is returned)."""
        try:
            return fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the turn's own error, handed to its consumer
            self._fail(job, exc)
            return None

    def _run(self, job: Job, step, *args) -> None:
        """One of ``job``'s steps; its token goes out, its error ends it alone."""
        token = self._call(job, step, *args)
        if job.error is not None:
            return
        if token is not None:
            job._events.put((token, job.turn.detok.take()))
        if job.turn.done:
            self._end(job)

    def _end(self, job: Job) -> None:
        turn = job.turn
        self._call(job, turn.settle)  # a compression still owed (a turn that ended at its first token)
        if job.error is not None:
            return
        report = turn.finish()
        if report is not None:
            report.queue_s = job.queue_s
        final = turn.detok.take(final=True) if turn.detok is not None and report is not None else ""
        self._leave(job, final)

    def _fail(self, job: Job, error: BaseException) -> None:
        job.error = error
        self._leave(job, "")

    def _leave(self, job: Job, final: str) -> None:
        if job in self._running:
            self._running.remove(job)
        job._events.put((_END, final))
        job.ended.set()
        self.stats["replays" if isinstance(job.turn, Replaying) else "turns"] += 1

    def _count(self, rows: int, tokens: int) -> None:
        if not tokens:
            return
        self.stats.update(steps=1, tokens=tokens, rows=rows)
        if rows:
            self.stats["decode_steps"] += 1
            self.stats[f"batch_le_{_bucket(rows, BATCH_BUCKETS)}"] += 1
        self.stats[f"tokens_le_{_bucket(tokens, TOKEN_BUCKETS)}"] += 1


def _bucket(value: int, buckets: tuple[int, ...]) -> str:
    return next((str(b) for b in buckets if value <= b), "inf")
