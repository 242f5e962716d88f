"""The affinity router's choices, without Ray: fake replicas, a fake Redis that can stop answering.

On a busy machine the router's owner lookup (on the ingress's event loop) can run past its
timeout; the turn must still go to the replica that holds the session, its first follow-up
included (bench/service/suite.py's routing phase moved such turns when the machine was loaded).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis

from kvsnap.service.routing import AffinityRouter


class FakeRedis:
    """The owner field of each session hash; ``down``: every call times out, as a slow Redis does."""

    def __init__(self):
        self.owners: dict[str, str] = {}
        self.down = False

    async def hget(self, key: str, field: str):
        assert field == "owner"
        if self.down:
            raise redis.TimeoutError("Timeout reading from socket")
        owner = self.owners.get(key.rsplit(":", 1)[-1])
        return owner.encode() if owner else None


def replica(name: str, kv_bytes: int = 0, sessions: int = 0):
    stats = {"kv_bytes": kv_bytes, "sessions": sessions, "ongoing": 0, "draining": False}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats=stats)


def request(key: str):
    return SimpleNamespace(metadata=SimpleNamespace(session_id=key), routing_context=SimpleNamespace())


@pytest.fixture
def router():
    r = AffinityRouter.__new__(AffinityRouter)  # no Serve deployment behind it: state only
    r.initialize_state(redis_url="redis://127.0.0.1:1", overload_queue_len=8)
    r.redis = FakeRedis()
    r._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: None)
    return r


def choose(router, key, replicas):
    pending = request(key)
    ranked = asyncio.run(router.choose_replicas(replicas, pending))
    return pending, [[r.replica_id.unique_id for r in rank] for rank in ranked]


def test_a_turn_goes_to_the_owner_redis_names(router):
    a, b = replica("a", kv_bytes=10), replica("b", kv_bytes=0)
    router.redis.owners["s1"] = "a"
    assert choose(router, "t/s1", [a, b])[1] == [["a"]]


def test_a_first_follow_up_stays_where_its_open_went_when_redis_does_not_answer(router):
    a, b = replica("a"), replica("b")
    pending, ranked = choose(router, "t/s1", [a, b])  # the open: no owner yet, placed by load
    assert sorted(ranked) == [["a"], ["b"]]
    router.on_request_routed(pending, b.replica_id, None)  # Serve sent it to b, which commits it
    b.routing_stats.update(kv_bytes=1 << 20, sessions=1)  # b now holds more: placement would pick a
    router.redis.down = True  # the first follow-up's lookup times out
    assert choose(router, "t/s1", [a, b])[1] == [["b"]]
    assert choose(router, "t/s2", [a, b])[1] == [["a"], ["b"]]  # a session never routed here: by load


def test_redis_wins_over_what_the_router_remembers(router):
    a, b = replica("a"), replica("b")
    pending, _ = choose(router, "t/s1", [a, b])
    router.on_request_routed(pending, a.replica_id, None)
    router.redis.owners["s1"] = "b"  # another ingress moved it since
    assert choose(router, "t/s1", [a, b])[1] == [["b"]]
    router.redis.down = True
    assert choose(router, "t/s1", [a, b])[1] == [["b"]]  # the last owner Redis named


def test_round_robin_remembers_nothing(router):
    router.affinity = False
    a, b = replica("a"), replica("b")
    pending, ranked = choose(router, "t/s1", [a, b])
    assert sorted(ranked) == [["a"], ["b"]]
    router.on_request_routed(pending, a.replica_id, None)
    assert router._owners == {}


def test_a_new_session_on_a_shared_prefix_goes_to_a_replica_holding_it(router):
    a, b, c = replica("a", kv_bytes=5 << 20, sessions=1), replica("b"), replica("c", kv_bytes=1 << 20, sessions=1)
    a.routing_stats["prefix_roots"] = ["doc1"]
    assert choose(router, "t/s1#doc1", [a, b, c])[1] == [["a"], ["b"], ["c"]]  # the holder, then by load
    assert choose(router, "t/s2#doc2", [a, b, c])[1] == [["b"], ["c"], ["a"]]  # nobody holds it: by load
    a.routing_stats["ongoing"] = 8  # overloaded: the holder goes last among equals by load
    assert choose(router, "t/s3#doc1", [a, b, c])[1][0] == ["b"]


def test_a_prefix_placed_a_moment_ago_draws_the_next_session_before_any_report(router):
    a, b = replica("a"), replica("b")
    pending, _ = choose(router, "t/s1#doc1", [a, b])
    router.on_request_routed(pending, b.replica_id, None)  # the document's first chat went to b
    b.routing_stats.update(kv_bytes=1 << 20, sessions=1)  # b's report does not list the prefix yet
    assert choose(router, "t/s2#doc1", [a, b])[1][0] == ["b"]
    assert router._owners["t/s1"] == "b"  # the session itself is remembered without the tag
