"""A stand-in for the worker deployment handle in tests of one ingress component (``SessionAPI``):
non-streaming calls (``handle.options(...).turn_once.remote(req)``) run on a real
``WorkerReplica`` body over a real in-process worker; a subclass decides what happens around
each call (``call``)."""

from __future__ import annotations

from kvsnap.actors.replica import WorkerReplica
from kvsnap.actors.worker import Worker


class ReplicaHandle:
    def __init__(self, worker: Worker):
        self.replica = WorkerReplica.__new__(WorkerReplica)  # the replica's methods, no Serve context
        self.replica.worker, self.replica.worker_id, self.replica.ongoing = worker, worker.worker_id, 0

    def options(self, **_):
        return self

    @property
    def turn_once(self):
        return self

    def remote(self, req):
        return Response(self.call(req))

    async def call(self, req) -> list[dict]:
        """The turn's events, as the replica returns them."""
        return self.replica.turn_once(req)


class Response:
    """Awaitable and cancellable, like a DeploymentResponse."""

    def __init__(self, coro):
        self.coro = coro

    def __await__(self):
        return self.coro.__await__()

    def cancel(self) -> None:
        self.coro.close()
