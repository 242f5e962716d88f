"""Tiered session KV and the Redis session directory, against a real redis-server process."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvsnap.actors.turns import TurnRequest
from kvsnap.actors.worker import Worker
from kvsnap.engine import Engine, SamplingParams
from kvsnap.errors import Conflict, NotFound, Unavailable
from kvsnap.policies import make_policy
from kvsnap.store.directory import SessionEntry
from kvsnap.store.redis_server import EmbeddedRedis
from kvsnap.store.tiers import build_store

from ..conftest import random_tokens

SAMPLING = SamplingParams(max_new_tokens=4)
FULL = make_policy("full")
ROW_BYTES = 2 * 2 * 2 * 16 * 4  # tiny-llama: layers x (k, v) x KV heads x head dim x fp32


def make_worker(engine, directory, worker_id="w1", device=10**9, host=10**9, disk=0, disk_dir=None):
    return Worker(engine, directory, build_store(device, host, disk, disk_dir), worker_id)


def reference(engine: Engine, turns: list[list[int]]) -> list[list[int]]:
    """The same turns on a plain in-process session: what an uninterrupted run answers."""
    session = engine.new_session(FULL)
    return [engine.turn(session, t, SAMPLING).tokens for t in turns]


def conversation(i: int) -> list[list[int]]:
    return [random_tokens(40, seed=1000 + i), random_tokens(7, seed=2000 + i)]


def check_budgets(worker: Worker) -> None:
    for tier in worker.store.tiers:
        assert tier.bytes_used <= tier.budget, f"{tier.name} tier over budget"
        assert tier.bytes_used == sum(b.nbytes for b in getattr(tier, "blobs", {}).values()) or tier.name == "disk"


def test_fifty_sessions_through_a_device_budget_of_ten(llama_engine, directory_factory, tmp_path):
    per_session = (40 + SAMPLING.max_new_tokens - 1) * ROW_BYTES
    worker = make_worker(
        llama_engine,
        directory_factory(),
        device=10 * per_session,
        host=15 * per_session,
        disk=15 * per_session,
        disk_dir=tmp_path / "disk",
    )
    sessions = {f"s{i}": conversation(i) for i in range(50)}
    answers = {}
    for sid, turns in sessions.items():
        answers[sid] = [worker.open("acme", sid, turns[0], FULL, sampling=SAMPLING).tokens]
        check_budgets(worker)
    assert worker.store.sessions_by_tier() == {"device": 10, "host": 15, "disk": 15}
    # the directory follows demotions: each session's state names the tier its KV is in now
    assert {sid: worker.state("acme", sid).tier for sid in sessions} == {
        sid: worker.store.tier_of(f"acme/{sid}") or "dropped" for sid in sessions
    }
    for sid, turns in reversed(sessions.items()):  # hottest first: hits on every tier, then rebuilds
        answers[sid].append(worker.turn("acme", sid, turns[1], SAMPLING).tokens)
        check_budgets(worker)
    for sid, turns in sessions.items():
        assert answers[sid] == reference(llama_engine, turns), sid
    stats = worker.stats()
    assert stats["demotions"]["device->host"] > 0 and stats["demotions"]["host->disk"] > 0
    assert stats["promotions"]["host->device"] > 0 and stats["promotions"]["disk->device"] > 0
    assert stats["dropped"] > 0 and stats["rebuilds"] > 0  # 10 did not fit anywhere: rebuilt from the log
    assert min(stats["hit_device"], stats["hit_host"], stats["hit_disk"]) > 0
    assert stats["hit_device"] + stats["hit_host"] + stats["hit_disk"] + stats["rebuilds"] == 50


@pytest.mark.parametrize("where", ["host", "disk"])
def test_corrupt_blob_is_detected_and_rebuilt(llama_engine, directory_factory, tmp_path, where):
    per_session = 50 * ROW_BYTES
    host = 10**9 if where == "host" else 0
    worker = make_worker(
        llama_engine, directory_factory(), device=per_session, host=host, disk=10**9, disk_dir=tmp_path
    )
    a, b = conversation(1), conversation(2)
    worker.open("acme", "a", a[0], FULL, sampling=SAMPLING)
    first = worker.open("acme", "b", b[0], FULL, sampling=SAMPLING).tokens
    # both seen once: b, the newer, is due back later (policies/eviction.py), so b goes down
    assert worker.store.tier_of("acme/b") == where and worker.store.tier_of("acme/a") == "device"
    tier = next(t for t in worker.store.tiers if t.name == where)
    if where == "host":
        with torch.inference_mode():
            tier.blobs["acme/b"].tensors[0].view(-1)[5] += 1.0  # a flipped value in memory
    else:
        path = tier.path("acme/b")
        path.write_bytes(path.read_bytes()[:-100])  # a truncated file
    second = worker.turn("acme", "b", b[1], SAMPLING)
    assert second.source == "rebuilt" and worker.store.stats.corrupt == 1
    assert [first, second.tokens] == reference(llama_engine, b)


def test_redis_killed_and_restarted_loses_nothing(llama_engine, tmp_path):
    server = EmbeddedRedis(tmp_path / "data").start()
    try:
        from kvsnap.store.directory import SessionDirectory

        worker = make_worker(llama_engine, SessionDirectory(server.url))
        convs = {f"s{i}": conversation(i) for i in range(4)}
        answers = {sid: [worker.open("acme", sid, t[0], FULL, sampling=SAMPLING).tokens] for sid, t in convs.items()}

        server.kill()  # a crash: SIGKILL
        started = time.monotonic()
        with pytest.raises(Unavailable):
            worker.open("acme", "new-one", random_tokens(40, seed=5), FULL)
        assert time.monotonic() - started < 2.5  # fails fast, never hangs
        # a session this worker holds still answers while Redis is down
        answers["s0"].append(worker.turn("acme", "s0", convs["s0"][1], SAMPLING).tokens)

        server = EmbeddedRedis(tmp_path / "data", port=server.port).start()  # same data directory
        worker.heartbeat()  # replays the turn served while Redis was down
        assert worker.directory.get("acme", "s0").turns == 2
        fresh = make_worker(llama_engine, SessionDirectory(server.url), worker_id="w2")  # holds nothing
        for sid in ("s1", "s2", "s3"):
            answers[sid].append(fresh.turn("acme", sid, convs[sid][1], SAMPLING).tokens)
        for sid, t in convs.items():
            assert answers[sid] == reference(llama_engine, t), sid

        server.stop()  # now an empty Redis: no data directory
        server = EmbeddedRedis(tmp_path / "empty", port=server.port).start()
        worker.heartbeat()  # re-registers every session this worker holds
        assert worker.directory.get("acme", "s0") is not None
        extra = random_tokens(5, seed=77)
        assert worker.turn("acme", "s0", extra, SAMPLING).tokens == reference(llama_engine, convs["s0"] + [extra])[-1]
    finally:
        server.stop()


def test_turns_served_while_redis_was_down_survive_a_turn_before_the_next_heartbeat(llama_engine, tmp_path):
    from kvsnap.store.directory import SessionDirectory

    server = EmbeddedRedis(tmp_path / "data").start()
    try:
        worker = make_worker(llama_engine, SessionDirectory(server.url))
        conv = conversation(11) + [random_tokens(6, seed=88)]
        answers = [worker.open("acme", "s", conv[0], FULL, sampling=SAMPLING).tokens]
        server.kill()
        answers.append(worker.turn("acme", "s", conv[1], SAMPLING).tokens)  # kept locally (Redis down)
        server = EmbeddedRedis(tmp_path / "data", port=server.port).start()
        # Redis is back with the older version; the next turn comes before any heartbeat
        answers.append(worker.turn("acme", "s", conv[2], SAMPLING).tokens)
        entry = worker.directory.get("acme", "s")
        assert entry.turns == 3 and worker.counters["conflicts"] == 0  # the offline turn was not lost
        assert answers == reference(llama_engine, conv)
        assert len(worker.directory.tokens("acme", "s")) == entry.log_len
    finally:
        server.stop()


def test_empty_redis_is_refilled_on_the_next_turn(llama_engine, tmp_path):
    from kvsnap.store.directory import SessionDirectory

    server = EmbeddedRedis(tmp_path / "one").start()
    try:
        worker = make_worker(llama_engine, SessionDirectory(server.url))
        conv = conversation(9)
        first = worker.open("acme", "s", conv[0], FULL, sampling=SAMPLING).tokens
        server.stop()
        server = EmbeddedRedis(tmp_path / "two", port=server.port).start()
        # no heartbeat in between: the turn itself notices and re-registers
        second = worker.turn("acme", "s", conv[1], SAMPLING).tokens
        assert [first, second] == reference(llama_engine, conv)
        assert worker.counters["resyncs"] == 1
    finally:
        server.stop()


def test_new_worker_resumes_every_session_from_the_token_log(llama_engine, directory_factory):
    directory = directory_factory()
    old = make_worker(llama_engine, directory, worker_id="old")
    convs = {f"s{i}": conversation(i) for i in range(5)}
    answers = {sid: [old.open("acme", sid, t[0], FULL, sampling=SAMPLING).tokens] for sid, t in convs.items()}
    del old  # the worker dies with its tiers
    new = make_worker(llama_engine, directory, worker_id="new")
    for sid, t in convs.items():
        result = new.turn("acme", sid, t[1], SAMPLING)
        assert result.source == "rebuilt"
        answers[sid].append(result.tokens)
        assert answers[sid] == reference(llama_engine, t), sid
    assert directory.get("acme", "s0").owner == "new"


def test_snapkv_session_survives_a_rebuild(llama_engine, directory_factory):
    directory = directory_factory()
    policy = make_policy("snapkv", budget=10, window=4, kernel=3)
    old = make_worker(llama_engine, directory, worker_id="old")
    old.open("acme", "s", random_tokens(60, seed=3), policy, sampling=SAMPLING)
    new = make_worker(llama_engine, directory, worker_id="new")
    result = new.turn("acme", "s", random_tokens(6, seed=4), SAMPLING)
    entry = directory.get("acme", "s")
    assert result.source == "rebuilt" and entry.kept_len <= 10 + 7 + SAMPLING.max_new_tokens
    assert entry.policy_fingerprint == policy.fingerprint() and entry.turns == 2


def test_concurrent_updates_exactly_one_wins(directory_factory):
    directory = directory_factory()
    directory.create(SessionEntry("acme", "s", owner="w0"), [1, 2, 3])
    barrier = threading.Barrier(2)
    outcomes = []

    def writer(name):
        entry = directory.get("acme", "s")
        entry.owner = name
        barrier.wait()
        try:
            directory.commit(entry, expected_version=1, new_tokens=[7])
            outcomes.append(("won", name))
        except Conflict:
            outcomes.append(("conflict", name))

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o for o, _ in outcomes) == ["conflict", "won"]
    winner = next(n for o, n in outcomes if o == "won")
    entry = directory.get("acme", "s")
    assert entry.owner == winner and entry.version == 2
    assert directory.tokens("acme", "s") == [1, 2, 3, 7]  # the loser appended nothing


def test_ttl_expiry_removes_every_key_of_an_idle_session(llama_engine, directory_factory):
    directory = directory_factory(session_ttl_s=1)
    worker = make_worker(llama_engine, directory)
    worker.open(
        "acme",
        "idle",
        random_tokens(20, seed=1),
        FULL,
        sampling=SAMPLING,
        log=[{"role": "document", "content": "..."}],
    )
    keys = directory.session_keys("acme", "idle")  # entry, token log, message log
    assert all(directory.client.exists(k) for k in keys)
    assert all(0 < directory.client.pttl(k) <= 1000 for k in keys)
    time.sleep(1.3)
    assert not any(directory.client.exists(k) for k in keys)
    worker.heartbeat()  # the worker forgets it too, and does not bring it back
    with pytest.raises(NotFound):
        worker.turn("acme", "idle", [5, 6], SAMPLING)


def test_tenants_do_not_see_each_other(llama_engine, directory_factory):
    worker = make_worker(llama_engine, directory_factory())
    worker.open("tenant-a", "shared-id", random_tokens(20, seed=1), FULL)
    with pytest.raises(NotFound) as other:
        worker.turn("tenant-b", "shared-id", [5], SAMPLING)
    with pytest.raises(NotFound) as missing:
        worker.turn("tenant-b", "never-was", [5], SAMPLING)
    assert str(other.value).replace("shared-id", "X") == str(missing.value).replace("never-was", "X")


def test_second_concurrent_turn_conflicts_and_open_twice_conflicts(llama_engine, directory_factory):
    worker = make_worker(llama_engine, directory_factory())
    worker.open("acme", "s", random_tokens(20, seed=1), FULL)
    stream = worker.stream(TurnRequest("acme", "s", [5, 6], SamplingParams(max_new_tokens=20)))
    next(iter(stream))
    with pytest.raises(Conflict, match="in progress"):
        worker.turn("acme", "s", [7], SAMPLING)
    stream.close()  # the first turn commits what it generated (the batch may be a step or two ahead of us)
    entry = worker.directory.get("acme", "s")
    generated = stream.report.generated_tokens
    assert 1 <= generated <= 20 and entry.turns == 2 and entry.log_len == 20 + 2 + generated
    with pytest.raises(Conflict, match="already exists"):
        worker.open("acme", "s", random_tokens(20, seed=2), FULL)


def test_drained_worker_hands_its_kv_over(llama_engine, directory_factory):
    directory = directory_factory()
    old, new = make_worker(llama_engine, directory, "old"), make_worker(llama_engine, directory, "new")
    conv = conversation(3)
    first = old.open("acme", "s", conv[0], FULL, sampling=SAMPLING).tokens
    assert old.drain() == 1
    with pytest.raises(Unavailable, match="draining"):
        old.turn("acme", "s", conv[1], SAMPLING)
    second = new.turn("acme", "s", conv[1], SAMPLING)
    assert second.source == "imported" and new.counters["moves_in"] == 1
    assert [first, second.tokens] == reference(llama_engine, conv)
    assert directory.get("acme", "s").owner == "new"


def test_message_log_follows_the_turns(llama_engine, directory_factory):
    worker = make_worker(llama_engine, directory_factory())
    doc = [{"role": "system", "content": "a document"}, {"role": "user", "content": "q1"}]
    first = worker.open(
        "acme", "s", random_tokens(20, seed=1), FULL, sampling=SAMPLING, log=doc, answer_role="assistant"
    )
    second = worker.turn(
        "acme", "s", [7, 8], SAMPLING, log=[{"role": "user", "content": "q2"}], answer_role="assistant"
    )
    assert worker.messages("acme", "s") == [
        *doc,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": second.text},
    ]
