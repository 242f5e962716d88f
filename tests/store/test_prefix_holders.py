"""The directory of shared prefix holders (store/prefix_holders.py), on the real redis-server:
workers report what they hold, reports lapse with the heartbeat TTL, a worker's heartbeat and a
registered document's prefill report it, and the router sends a new session on a document to
a holder that only the directory names (another ingress placed it; no stats list it yet)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from kvsnap.actors.worker import Worker
from kvsnap.engine import Engine
from kvsnap.engine.prefixes import root_key
from kvsnap.store.prefix_holders import holders_of
from kvsnap.store.tiers import build_store

from ..conftest import random_tokens
from ..service.test_affinity_router import choose, replica
from ..service.test_affinity_router import router as router  # noqa: F401 (the fixture)

DOCUMENT = random_tokens(50, seed=41)


def test_workers_report_what_they_hold_and_reports_lapse(directory_factory, redis_server):
    directory = directory_factory(heartbeat_ttl_s=1)
    directory.publish_prefixes("w1", ["aa", "bb"])
    directory.publish_prefixes("w2", ["aa"])
    directory.publish_prefixes("w3", [])  # nothing held: nothing written
    assert directory.prefix_holders("aa") == {"w1", "w2"} and directory.prefix_holders("bb") == {"w1"}
    assert directory.prefix_holders("cc") == set()

    async def read():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            return await holders_of(client, directory.prefix, "aa", 1)
        finally:
            await client.aclose()

    assert asyncio.run(read()) == {"w1", "w2"}
    deadline = time.monotonic() + 30
    while directory.prefix_holders("aa") and time.monotonic() < deadline:
        directory.publish_prefixes("w2", ["aa"])  # w2 keeps reporting, w1 stopped
        if directory.prefix_holders("aa") == {"w2"}:
            break
        time.sleep(0.2)
    assert directory.prefix_holders("aa") == {"w2"}


def test_a_heartbeat_and_a_registered_document_report_the_workers_prefixes(tiny_engine, directory_factory):
    engine = Engine(tiny_engine.loaded, prefill_chunk=tiny_engine.prefill_chunk, prefix_cache_bytes=64 << 20)
    directory = directory_factory()
    worker = Worker(engine, directory, build_store(10**9, 10**9), "w1")
    try:
        root = root_key("acme", DOCUMENT, engine.prefill_chunk)
        assert directory.prefix_holders(root) == set()
        assert worker.hold_prefix("acme", DOCUMENT) == 48  # reported at once
        assert directory.prefix_holders(root) == {"w1"}
        assert root in engine.prefixes.roots()
        directory.client.delete(f"{directory.prefix}:p:{root}")  # Redis lost it: the heartbeat reports it again
        worker.heartbeat()
        assert directory.prefix_holders(root) == {"w1"}
        assert directory.prefix_holders(root_key("other", DOCUMENT, engine.prefill_chunk)) == set()
    finally:
        worker.stop()


def test_a_document_the_directory_places_draws_new_sessions_before_any_stats(router, directory_factory, redis_server):  # noqa: F811
    directory = directory_factory()
    directory.publish_prefixes("b", ["d0c1"])  # another ingress's router sent its first chat to b
    a, b = replica("a"), replica("b", kv_bytes=1 << 20, sessions=1)  # by load alone, a comes first
    router.prefix = directory.prefix
    router.redis = aioredis.Redis.from_url(redis_server.url)  # the owner and holders, from the real server
    assert choose(router, "t/s1#d0c1", [a, b])[1] == [["b"], ["a"]]
    router.redis = aioredis.Redis.from_url(redis_server.url)  # a client per event loop
    assert choose(router, "t/s2#d0c2", [a, b])[1] == [["a"], ["b"]]  # a document nobody holds: by load


def test_a_failed_report_never_fails_a_registered_document_or_a_heartbeat(tiny_engine, directory_factory, monkeypatch):
    import redis

    engine = Engine(tiny_engine.loaded, prefill_chunk=tiny_engine.prefill_chunk, prefix_cache_bytes=64 << 20)
    directory = directory_factory()
    worker = Worker(engine, directory, build_store(10**9, 10**9), "w1")

    def refuse(*args):
        raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'")

    monkeypatch.setattr(directory, "publish_prefixes", refuse)
    try:
        assert worker.hold_prefix("acme", DOCUMENT) == 48  # the rows are held; only the hint failed
        worker.heartbeat()
    finally:
        worker.stop()


def test_a_hung_holders_lookup_does_not_hold_a_new_session_up(router):  # noqa: F811
    class Hung:
        async def hget(self, key, field):
            return None

        async def eval(self, *args):
            await asyncio.sleep(30)

    router.redis = Hung()
    a, b = replica("a"), replica("b", kv_bytes=1 << 20, sessions=1)
    began = time.monotonic()
    assert choose(router, "t/s1#d0c1", [a, b])[1] == [["a"], ["b"]]  # placed by load
    assert time.monotonic() - began < 10  # bounded by HOLDERS_TIMEOUT_S, not the hung call
