"""The worker replica and what it does: a Ray Serve replica (:mod:`.replica`, a Ray actor) runs
one :class:`~.worker.Worker`, which runs turns (:mod:`.turns`, the typed turn contract) on the
sessions its :class:`~.sessions.SessionStore` loads and commits. ``Worker`` and the store work
in-process too (tests, benchmarks); only the replica needs Ray."""

from .sessions import SessionStore
from .turns import SessionSpec, TurnRequest
from .worker import Worker

__all__ = ["SessionSpec", "SessionStore", "TurnRequest", "Worker"]
