"""One tenant's flood cannot take every place the replicas have: the ingress lets a tenant have at
most ``max_tenant_turns`` turns in flight (429 past them, before any model work), and another
tenant's turns go on meanwhile. One component (``SessionAPI``) on a real in-process worker and a
real redis-server; the worker deployment handle is a stand-in that holds each turn at a gate, so
that the turns in flight are the test's to count."""

from __future__ import annotations

import asyncio

import pytest

from kvsnap.actors.worker import Worker
from kvsnap.errors import ResourceExhausted
from kvsnap.policies import make_policy
from kvsnap.service.api import SessionAPI
from kvsnap.service.config import ServiceConfig
from kvsnap.service.metrics import Metrics
from kvsnap.service.status import http_status
from kvsnap.store.tiers import build_store

from ..conftest import random_tokens
from .handles import ReplicaHandle


class GatedWorkers(ReplicaHandle):
    """The worker deployment handle, holding each turn until ``gate`` opens; ``calls`` counts
    the turns that reached it."""

    def __init__(self, worker: Worker):
        super().__init__(worker)
        self.gate = asyncio.Event()
        self.calls = 0

    async def call(self, req) -> list[dict]:
        self.calls += 1
        await self.gate.wait()
        return self.replica.turn_once(req)


@pytest.fixture
def api(llama_engine, directory_factory):
    directory = directory_factory()
    worker = Worker(llama_engine, directory, build_store(10**9, 10**9), "w1")
    for tenant, sid in (("a", "s1"), ("a", "s2"), ("a", "s3"), ("b", "s1")):
        worker.open(tenant, sid, random_tokens(30, seed=len(sid)), make_policy("full"))
    cfg = ServiceConfig(model="tiny-llama", request_timeout_s=30, max_tenant_turns=2)
    return SessionAPI(cfg, GatedWorkers(worker), llama_engine.tokenizer, directory, Metrics(loads=dict))


def ask(api: SessionAPI, tenant: str, sid: str):
    return api.collect(api.turn(tenant, sid, "Next?", {"max_tokens": 3}, False, "http", streaming=False))


async def until(condition) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_a_tenant_past_its_turns_in_flight_gets_429_and_another_tenant_goes_on(api):
    async def main():
        held = [asyncio.create_task(ask(api, "a", sid)) for sid in ("s1", "s2")]
        await until(lambda: api.workers.calls == 2)
        before = api.directory.get("a", "s3")
        with pytest.raises(ResourceExhausted, match="2 turns in flight") as refused:
            await ask(api, "a", "s3")
        assert http_status(refused.value) == 429
        assert api.workers.calls == 2 and api.directory.get("a", "s3") == before  # refused before any work
        other = asyncio.create_task(ask(api, "b", "s1"))  # another tenant is not held back
        await until(lambda: api.workers.calls == 3)
        api.workers.gate.set()
        outcomes = await asyncio.gather(*held, other)
        assert [o.state["turns"] for o in outcomes] == [before.turns + 1] * 3  # each ran once
        assert (await ask(api, "a", "s3")).state["turns"] == before.turns + 1  # a place came free
        assert not api.in_flight

    asyncio.run(main())


def test_a_turn_whose_client_went_away_frees_its_place(api):
    async def main():
        gone = asyncio.create_task(ask(api, "a", "s1"))
        await until(lambda: api.in_flight["a"] == 1)
        gone.cancel()  # the client disconnected while its turn waited
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not api.in_flight
        stream = api.turn("a", "s2", "Next?", {"max_tokens": 3}, False, "http", streaming=False)
        waiting = asyncio.create_task(stream.__anext__())
        await until(lambda: api.in_flight["a"] == 1)
        api.workers.gate.set()
        await waiting
        await stream.aclose()  # closed after its first event: the place is free again
        assert not api.in_flight

    asyncio.run(main())


def test_the_default_leaves_a_quarter_of_the_workers_places_to_other_tenants():
    assert ServiceConfig(replicas=2, max_ongoing_requests=32, max_queued_requests=16).tenant_turns() == 60
    assert ServiceConfig(replicas=1, max_ongoing_requests=1, max_batch=1, max_queued_requests=0).tenant_turns() == 1
    assert ServiceConfig(max_tenant_turns=5).tenant_turns() == 5
