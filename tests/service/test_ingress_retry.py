"""The ingress's retry rule for a turn whose replica died: retry only when the turn was not
committed. One component (``SessionAPI``) on a real in-process worker and a real redis-server;
the worker deployment handle is a stand-in that can lose the replica before the turn runs or
after it committed (the answer lost). The real replica kills are in bench/reliability/suite.py."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions

from kvsnap.actors.worker import Worker
from kvsnap.errors import Unavailable
from kvsnap.policies import make_policy
from kvsnap.service.api import SessionAPI
from kvsnap.service.config import ServiceConfig
from kvsnap.service.metrics import Metrics
from kvsnap.service.template import encode_messages
from kvsnap.store.tiers import build_store

from ..conftest import random_tokens
from .handles import ReplicaHandle


class FlakyWorkers(ReplicaHandle):
    """The worker deployment handle, failing the calls named in ``failures`` ("before": the
    replica dies before the turn runs; "after": it dies after its commit, before the answer
    arrives)."""

    def __init__(self, worker: Worker, failures: list[str]):
        super().__init__(worker)
        self.failures = list(failures)
        self.turn_ids: list[str] = []

    def remote(self, req):
        self.turn_ids.append(req.turn_id)
        return super().remote(req)

    async def call(self, req) -> list[dict]:
        failure = self.failures.pop(0) if self.failures else None
        if failure == "before":
            raise ray.exceptions.RayActorError()
        events = self.replica.turn_once(req)
        if failure == "after":
            raise ray.exceptions.RayActorError()
        return events


@pytest.fixture
def api_for(llama_engine, directory_factory):
    """``api_for(failures)``: a SessionAPI whose handle fails as told, and one open session "s"."""

    def make(failures: list[str]) -> tuple[SessionAPI, FlakyWorkers]:
        directory = directory_factory()
        worker = Worker(llama_engine, directory, build_store(10**9, 10**9), "w1")
        worker.open("t", "s", random_tokens(40, seed=1), make_policy("full"))
        workers = FlakyWorkers(worker, failures)
        cfg = ServiceConfig(model="tiny-llama", request_timeout_s=30)
        api = SessionAPI(cfg, workers, llama_engine.tokenizer, directory, Metrics(loads=dict))
        return api, workers

    return make


async def ask(api: SessionAPI) -> dict:
    events = api.turn("t", "s", "Next?", {"max_tokens": 4}, False, "http", streaming=False)
    return (await api.collect(events)).state


def test_a_turn_lost_before_it_ran_is_retried_and_applied_once(api_for, llama_engine, monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_wait)
    api, workers = api_for(["before"])
    before = api.directory.get("t", "s")
    state = asyncio.run(ask(api))
    assert len(workers.turn_ids) == 2 and workers.turn_ids[0] == workers.turn_ids[1]  # the same turn, sent twice
    after = api.directory.get("t", "s")
    assert after.turns == before.turns + 1 and after.version == before.version + 1 == state["version"]  # applied once
    assert after.last_turn == workers.turn_ids[0]
    question = encode_messages(llama_engine.tokenizer, [{"role": "user", "content": "Next?"}], False)
    assert after.log_len == before.log_len + len(question) + 4


def test_a_turn_committed_before_its_answer_was_lost_is_not_applied_twice(api_for, monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_wait)
    api, workers = api_for(["after"])
    before = api.directory.get("t", "s")
    with pytest.raises(Unavailable, match="may have been applied"):
        asyncio.run(ask(api))
    assert len(workers.turn_ids) == 1  # not sent again
    after = api.directory.get("t", "s")
    assert after.version == before.version + 1 and after.turns == before.turns + 1
    assert after.last_turn == workers.turn_ids[0]


def test_every_turn_has_its_own_id(api_for):
    api, workers = api_for([])
    asyncio.run(ask(api))
    asyncio.run(ask(api))
    assert len(set(workers.turn_ids)) == 2
    assert api.directory.get("t", "s").last_turn == workers.turn_ids[-1]


async def _no_wait(_seconds: float) -> None:  # the retry back-off, skipped
    return None


def test_a_stream_that_ends_without_a_result_is_unavailable_and_closed():
    """A worker stream that stops before its done event (its replica went away mid-turn): every
    non-streaming path (``SessionAPI.collect``: the session, OpenAI and completion routes) answers
    Unavailable (503: the client may retry), and closes the stream."""
    closed = []

    async def events():
        try:
            yield {"t": 1}
        finally:
            closed.append(True)

    with pytest.raises(Unavailable, match="without a result"):
        asyncio.run(SessionAPI.collect(events()))
    assert closed == [True]
