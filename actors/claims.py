"""Claims: one turn per session at a time on a worker. A second concurrent turn on a session
gets Conflict (HTTP 409) before any model work; a drain waits until no claim is held.

A turn that has ended (its commit is being written: the session's state may already show it)
still holds its claim for the few milliseconds of its bookkeeping. A turn that arrives then is
the next turn, not a concurrent one: it waits for that release (at most ``ENDING_WAIT_S``)
instead of getting Conflict, so a client that saw the turn committed can always go on. (A
retry of the ended turn that arrives in those milliseconds runs after it, as it would a moment
later; an implicit session's turn still checks the version it was matched at.)"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from kvsnap.errors import Conflict

ENDING_WAIT_S = 10.0  # how long a turn waits for an ended turn's claim to be released


class Claim:
    """One turn's hold on a session: a second concurrent turn gets Conflict. ``release`` is
    idempotent and never frees a later turn's claim; as a context manager it releases on exit."""

    __slots__ = ("key", "owner", "ending")

    def __init__(self, key: str, owner: Claims):
        self.key, self.owner = key, owner
        self.ending = False  # the turn is over and is being committed: the next turn may wait

    def end(self) -> None:
        """The turn is over (it is being committed or dropped): a turn that arrives now waits
        for the release instead of getting Conflict."""
        self.ending = True

    def release(self) -> None:
        with self.owner.lock:
            if self.owner.busy.get(self.key) is self:
                del self.owner.busy[self.key]
                self.owner.released.notify_all()

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Claims:
    """The sessions of one worker with a turn in progress."""

    def __init__(self):
        self.busy: dict[str, Claim] = {}
        self.lock = threading.Lock()
        self.released = threading.Condition(self.lock)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no turn holds a claim (True: every turn in progress has committed), or
        ``timeout_s`` has passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    @contextmanager
    def claimed(self, key: str):
        """Claim ``key`` (one turn per session at a time: a second concurrent one gets Conflict,
        HTTP 409, before any model work). Released on an error; on success the caller keeps the
        claim (a turn's stream releases it when it ends) or releases it."""
        with self.lock:
            deadline = time.monotonic() + ENDING_WAIT_S
            while (held := self.busy.get(key)) is not None:
                left = deadline - time.monotonic()
                if not held.ending or left <= 0:
                    raise Conflict("another turn on this session is in progress")
                self.released.wait(left)  # the previous turn is committing: we are the next one
            claim = Claim(key, self)
            self.busy[key] = claim
        try:
            yield claim
        except BaseException:
            claim.release()
            raise
