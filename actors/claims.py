"""Claims: one turn per session at a time on a worker. A second concurrent turn on a session
gets Conflict (HTTP 409) before any model work; a drain waits until no claim is held."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from kvsnap.errors import Conflict


class Claim:
    """One turn's hold on a session: a second concurrent turn gets Conflict. ``release`` is
    idempotent and never frees a later turn's claim; as a context manager it releases on exit."""

    __slots__ = ("key", "owner")

    def __init__(self, key: str, owner: Claims):
        self.key, self.owner = key, owner

    def release(self) -> None:
        with self.owner.lock:
            if self.owner.busy.get(self.key) is self:
                del self.owner.busy[self.key]

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Claims:
    """The sessions of one worker with a turn in progress."""

    def __init__(self):
        self.busy: dict[str, Claim] = {}
        self.lock = threading.Lock()

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
            if key in self.busy:
                raise Conflict("another turn on this session is in progress")
            claim = Claim(key, self)
            self.busy[key] = claim
        try:
            yield claim
        except BaseException:
            claim.release()
            raise
