"""Cache affinity and session moves through the service: every follow-up lands on the replica
that holds its session, two sessions on one replica decode together, and a session moves when
its holder is overloaded, killed (rebuilt exactly) or drained (handed over)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvsnap.engine import Engine, load_model
from kvsnap.policies import make_policy
from kvsnap.service.template import encode_messages
from kvsnap.store.directory import SessionDirectory

from ..conftest import ADMIN_KEY
from .helpers import DOC, FULL, QUESTIONS, create, kill_replica, reference_answers, turn, wait_for, wait_for_workers


def test_every_follow_up_turn_lands_on_the_holder(service):
    holders = {}
    for i in range(20):
        response = create(service, f"aff-{i}", {"policy": "snapkv", "budget": 16, "window": 4})
        assert response.status_code == 201, response.text
    for i in range(20):
        first = turn(service, f"aff-{i}", "First question?").json()
        assert "worker" in first, first
        holders[f"aff-{i}"] = first["worker"]
        assert first["source"] in ("device", "host", "disk"), first
    assert len(set(holders.values())) == 2  # new sessions were spread over both replicas
    new_tokens = len(encode_messages(_tok(), [{"role": "user", "content": "Second one?"}], False)) + 1
    # Concurrent turns of different sessions: each still reaches its own holder. Two at a time:
    # this app's overload threshold is 3 turns in flight on one holder, and with three, a holder's
    # queue length seen by the router (a cache that lags finished turns) reached it now and then,
    # moving a turn away (a flake seen in CI). (The router must fulfil exactly the request it
    # routed; Serve's FIFOMixin did not, which bench/service/overhead_bench.py's 16 concurrent users
    # exposed: 24/48 turns on their holder, 48/48 after the fix.)
    with ThreadPoolExecutor(2) as pool:
        answers = dict(
            zip(holders, pool.map(lambda sid: turn(service, sid, "Second one?").json(), holders), strict=True)
        )
    for sid, holder in holders.items():
        answer = answers[sid]
        assert "worker" in answer, (sid, answer)
        assert answer["worker"] == holder and answer["source"] in ("device", "host", "disk"), (sid, answer)
        assert answer["prompt_tokens"] == new_tokens  # the document was not prefilled again


def _tok():
    from kvsnap.engine.models import ByteTokenizer

    return ByteTokenizer()


def _batch_steps(service, worker: str) -> tuple[float, float]:
    """(decode steps, steps of one row) of ``worker``'s batch, from /metrics."""
    text = requests.get(f"{service.http}/metrics", headers=service.headers()).text
    values = {}
    for line in text.splitlines():
        if line.startswith("kvsnap_batch_size_") and f'worker="{worker}"' in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0] + ("_le1" if 'le="1.0"' in name else "")] = float(value)
    return values.get("kvsnap_batch_size_count", 0.0), values.get("kvsnap_batch_size_bucket_le1", 0.0)


def test_concurrent_turns_on_one_replica_decode_together_and_equal_the_engine(service, llama_engine):
    """Continuous batching through the service: two sessions held by one replica answer at
    once, their turns share decode steps (the replica's batch-size histogram in /metrics), and
    every answer is the one the engine gives that conversation alone. (Two, not three: the
    test service gives a holder's sessions away at three requests in flight.) The router may
    still move one of the two (it judges the holder by load it last saw: once in a full run,
    a session moved with two in flight); the answer must then still be right, and the test
    tries again with new sessions, up to three times."""
    want = reference_answers(llama_engine, DOC, QUESTIONS[:2], [6, 60])[-1]
    seen = []
    for attempt in range(3):
        holders: dict[str, list[str]] = {}
        for i in range(3):  # two replicas: one of them holds two of three sessions
            sid = f"batch-{attempt}-{i}"
            assert create(service, sid).status_code == 201
            holders.setdefault(turn(service, sid, QUESTIONS[0]).json()["worker"], []).append(sid)
        worker, sids = max(holders.items(), key=lambda kv: len(kv[1]))
        sids = sids[:2]
        assert len(sids) == 2
        assert wait_for(lambda w=worker: _batch_steps(service, w)[0] > 0, 10)  # published with the heartbeat
        steps_before, single_before = _batch_steps(service, worker)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda sid: turn(service, sid, QUESTIONS[1], max_tokens=60).json(), sids))
        assert [answer["text"] for answer in answers] == [want, want]
        seen.append([(answer["worker"], answer["source"]) for answer in answers])
        if all(answer["worker"] == worker and answer["source"] == "device" for answer in answers):
            break
    else:
        pytest.fail(f"in three tries, no two concurrent turns stayed on their holder: {seen}")
    assert wait_for(lambda: _batch_steps(service, worker)[0] > steps_before, 10)
    steps, single = _batch_steps(service, worker)
    assert steps - steps_before > single - single_before  # some decode steps ran both sessions


def test_overloaded_holder_gives_up_the_session(service, llama_engine):
    assert create(service, "ovl-target", FULL).status_code == 201
    holder = turn(service, "ovl-target", QUESTIONS[0]).json()["worker"]
    busy = []
    i = 0
    while len(busy) < 3:  # three more sessions on the same holder, kept busy
        assert create(service, f"ovl-{i}", FULL, document="Busy. " * 10).status_code == 201
        if turn(service, f"ovl-{i}", "Hi", max_tokens=1).json()["worker"] == holder:
            busy.append(f"ovl-{i}")
        i += 1
    # The holder works on one turn at a time: three long ones in flight keep it busy for seconds.
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(turn, service, sid, "Talk.", max_tokens=3000, stream=True) for sid in busy]
        time.sleep(1.0)
        moved = turn(service, "ovl-target", QUESTIONS[1]).json()
        for s in streams:
            s.result().close()
    assert moved["worker"] != holder and moved["source"] == "rebuilt"
    assert moved["text"] == reference_answers(llama_engine, DOC, QUESTIONS[:2], 6)[-1]


def test_killed_holder_is_replaced_and_a_snapkv_session_rebuilt_exactly(service):
    """A compressed session (SnapKV, the default policy) rebuilt on another replica after its
    holder is killed answers exactly like an uninterrupted twin: the rebuild replays each turn."""
    settings = {"policy": "snapkv", "budget": 16, "window": 8, "kernel": 3}
    twin = Engine(load_model("tiny-llama"), prefill_chunk=service.cfg.prefill_chunk)
    want = reference_answers(twin, DOC, QUESTIONS, 6, make_policy("snapkv", budget=16, window=8, kernel=3))
    assert create(service, "kill-me", settings).status_code == 201
    first = turn(service, "kill-me", QUESTIONS[0]).json()
    holder = first["worker"]
    assert first["state"]["kept_len"] < first["state"]["logical_len"]  # compressed
    kill_replica(holder)
    second = turn(service, "kill-me", QUESTIONS[1])
    assert second.status_code == 200, second.text
    second = second.json()
    assert second["worker"] != holder and second["source"] == "rebuilt"  # no hand-over from a killed replica
    third = turn(service, "kill-me", QUESTIONS[2]).json()
    assert [first["text"], second["text"], third["text"]] == want
    wait_for_workers()


def test_drained_holder_hands_its_sessions_over_then_takes_sessions_again(service, llama_engine):
    sids = ["drain-a", "drain-b"]
    holders = {}
    for sid in sids:
        assert create(service, sid, FULL).status_code == 201
        holders[sid] = turn(service, sid, QUESTIONS[0]).json()["worker"]
    victim = holders["drain-a"]
    # long enough that the turns below reach another replica before the drain ends, also on a busy
    # machine where the router sees the draining flag late and the ingress retries meanwhile
    drained = requests.post(
        f"{service.http}/v1/admin/workers/{victim}/drain",
        params={"resume_after_s": 30},
        headers=service.headers(ADMIN_KEY),
    ).json()
    assert drained["exported"] >= 1 and drained["resume_after_s"] == 30
    directory = SessionDirectory(service.redis_url)
    assert wait_for(lambda: directory.loads()[victim]["draining"], 5)  # published with the heartbeat
    time.sleep(1.0)  # routing stats carry the draining flag within a second
    want = reference_answers(llama_engine, DOC, QUESTIONS[:2], 6)[-1]
    for sid in sids:
        answer = turn(service, sid, QUESTIONS[1]).json()
        if holders[sid] == victim:
            assert answer["worker"] != victim and answer["source"] == "imported"
        assert answer["text"] == want
    # the drain ends: the replica takes new sessions again (it holds the least KV, so it gets the next one)
    assert wait_for(lambda: not directory.loads()[victim]["draining"], 60)
    time.sleep(1.5)  # and the router has seen it
    placed = set()
    for i in range(4):
        assert create(service, f"after-drain-{i}", FULL).status_code == 201
        placed.add(turn(service, f"after-drain-{i}", "Hi", max_tokens=1).json()["worker"])
    assert victim in placed
