"""A rebuild replays history: after a replica kill, a drain, a tier demotion or a Redis wipe, a
compressed session answers exactly like an uninterrupted twin, and holds the same KV.

Real workers on a real redis-server; tiny random-weight models. A compressed session's cache
depends on where each turn's compression happened, so a one-pass re-prefill of its transcript
(what a rebuild did before the token log carried turn boundaries) gives another cache."""

from __future__ import annotations

import threading

import pytest
import torch

from kvsnap.actors import claims as claims_module
from kvsnap.actors.turns import TurnRequest
from kvsnap.actors.worker import Worker
from kvsnap.engine import SamplingParams
from kvsnap.errors import Conflict
from kvsnap.policies import make_policy
from kvsnap.store.tiers import build_store

from ..conftest import random_tokens

SAMPLING = SamplingParams(max_new_tokens=6)
# policy spec -> (policy, recompress); small budgets so that every turn really drops rows
POLICIES = {
    "snapkv": (lambda: make_policy("snapkv", budget=16, window=8, kernel=3), "per_turn"),
    "reselect": (lambda: make_policy("snapkv", budget=16, window=8, kernel=3), "reselect"),
    "streaming": (lambda: make_policy("streaming", window=12, sinks=4), "per_turn"),
    # mixed precision: the rows left out kept at 4 bits (engine/cold.py), two key groups of them
    "snapkv/q4": (lambda: make_policy("snapkv", budget=16, window=8, kernel=3, rest="kivi4"), "per_turn"),
    "snapkv+h2o": (
        lambda: make_policy(
            "snapkv", budget=16, window=8, kernel=3, decode={"policy": "h2o", "budget": 8, "window": 4}
        ),
        "per_turn",
    ),
}
DOCUMENT = random_tokens(60, seed=7)
QUESTIONS = [random_tokens(9, seed=70 + i) for i in range(4)]
BEFORE, AFTER = QUESTIONS[:2], QUESTIONS[2:]  # turns before the interruption, turns compared after it


def make_worker(engine, directory, worker_id: str, device: int = 10**9, **store) -> Worker:
    return Worker(engine, directory, build_store(device, 10**9, **store), worker_id)


def run_turns(worker: Worker, sid: str, questions: list[list[int]]) -> list[tuple[list[int], str]]:
    return [(r.tokens, r.source) for r in (worker.turn("acme", sid, q, SAMPLING) for q in questions)]


def stored_kv(worker: Worker, sid: str) -> list[torch.Tensor]:
    """The session's stored tensors, then its quantized rows' parts (a mixed-precision session's)."""
    blob = worker.store.peek(f"acme/{sid}")
    return blob.tensors + ([] if blob.cold is None else blob.cold[0])


def open_session(worker: Worker, sid: str, spec: str) -> None:
    make, recompress = POLICIES[spec]
    worker.open("acme", sid, DOCUMENT, make(), recompress, SAMPLING)
    run_turns(worker, sid, BEFORE)


@pytest.fixture
def twin(tiny_engine, directory_factory):
    """The uninterrupted run of each policy: answers after the interruption point, and its KV."""

    def run(spec: str):
        worker = make_worker(tiny_engine, directory_factory(), "twin")
        open_session(worker, "twin", spec)
        answers = [tokens for tokens, _ in run_turns(worker, "twin", AFTER)]
        return answers, stored_kv(worker, "twin"), worker

    return run


def assert_same_kv(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", sorted(POLICIES))
def test_replica_kill_and_redis_wipe_rebuild_the_same_session(spec, tiny_engine, directory_factory, twin):
    want, want_kv, twin_worker = twin(spec)
    directory = directory_factory()
    first = make_worker(tiny_engine, directory, "w1")
    open_session(first, "s", spec)
    first.stop()

    # a replica kill: the next worker has nothing but Redis
    second = make_worker(tiny_engine, directory, "w2")
    got = run_turns(second, "s", AFTER[:1])
    assert got[0][1] == "rebuilt" and second.counters["rebuilds"] == 1
    assert second.scheduler.stats["replays"] == 1  # in the batch (engine/replay.py), not between steps
    # Redis wiped: the holder writes the session (token log and turn marks) back ...
    wiped = list(directory.client.scan_iter(match=f"{directory.prefix}:*"))  # this test's keys only
    assert directory.client.delete(*wiped) and directory.get("acme", "s") is None
    second.heartbeat()
    assert directory.get("acme", "s") is not None
    # ... and a replica that never held it rebuilds it from what was written back
    third = make_worker(tiny_engine, directory, "w3")
    got += run_turns(third, "s", AFTER[1:])
    assert got[1][1] == "rebuilt"
    assert [tokens for tokens, _ in got] == want
    assert_same_kv(stored_kv(third, "s"), want_kv)
    if spec == "reselect":  # the full copy is rebuilt too, row for row
        assert_same_kv(third.store.peek("acme/s/full").tensors, twin_worker.store.peek("acme/twin/full").tensors)


@pytest.mark.parametrize("spec", sorted(POLICIES))
def test_drain_and_demotion_keep_the_session_exact(spec, tiny_engine, directory_factory, twin):
    want, want_kv, _ = twin(spec)
    directory = directory_factory()
    old = make_worker(tiny_engine, directory, "w1")
    open_session(old, "s", spec)
    assert old.drain() == 1
    # the drained holder's hand-over lands on a worker whose device tier holds one session at a time
    small = make_worker(tiny_engine, directory, "w2")
    small.open("acme", "other", random_tokens(20, seed=8), make_policy("full"), sampling=SAMPLING)
    small.store.tiers[0].budget = small.store.tiers[0].bytes_used + 1  # room for no second session
    got = run_turns(small, "s", AFTER[:1])
    assert got[0][1] == "imported"
    # both seen once here: s, the newer, is due back later (policies/eviction.py): it goes down
    assert small.store.tier_of("acme/s") == "host" and small.store.tier_of("acme/other") == "device"
    got += run_turns(small, "s", AFTER[1:])
    assert got[1][1] == "host"
    assert [tokens for tokens, _ in got] == want
    assert_same_kv(stored_kv(small, "s"), want_kv)


def test_a_one_pass_rebuild_would_differ(tiny_engine):
    """What the replay guards against: the same transcript prefilled and compressed once holds
    other rows than the session that compressed turn by turn (so the tests above can fail)."""
    make, recompress = POLICIES["snapkv"]
    session = tiny_engine.new_session(make(), recompress)
    tiny_engine.turn(session, DOCUMENT, SAMPLING)
    for q in BEFORE:
        tiny_engine.turn(session, q, SAMPLING)
    once = tiny_engine.new_session(make(), recompress)
    tiny_engine.rebuild(once, list(session.transcript), session.logical_len)  # no marks: one pass
    replayed = tiny_engine.new_session(make(), recompress)
    tiny_engine.rebuild(replayed, list(session.transcript), session.logical_len, session.marks)
    layer = next(i for i, layer in enumerate(session.cache.layers) if hasattr(layer, "kept_len"))
    assert torch.equal(replayed.cache.layers[layer].keys, session.cache.layers[layer].keys)
    assert once.cache.layers[layer].keys.shape != session.cache.layers[layer].keys.shape or not torch.equal(
        once.cache.layers[layer].keys, session.cache.layers[layer].keys
    )


def test_a_second_concurrent_turn_is_refused_before_any_model_work(llama_engine, directory_factory):
    worker = make_worker(llama_engine, directory_factory(), "w1")
    worker.open("acme", "busy", DOCUMENT, make_policy("full"), sampling=SAMPLING)
    first = worker.stream(TurnRequest("acme", "busy", QUESTIONS[0], SAMPLING))  # claimed, not yet running
    forwards = []
    hook = llama_engine.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(Conflict, match="in progress"):
            worker.stream(TurnRequest("acme", "busy", QUESTIONS[1], SAMPLING))
        assert forwards == []  # refused before the model ran
    finally:
        hook.remove()
    assert len(list(first)) == SAMPLING.max_new_tokens
    after = worker.turn("acme", "busy", QUESTIONS[1], SAMPLING)
    assert after.source == "device"
    assert worker.counters["rebuilds"] == 0 and worker.counters["conflicts"] == 0


class _Watched:
    """A claim table's release condition that says when a turn starts waiting on it."""

    def __init__(self, condition: threading.Condition):
        self.condition, self.waiting = condition, threading.Event()

    def wait(self, timeout: float) -> bool:
        self.waiting.set()
        return self.condition.wait(timeout)

    def notify_all(self) -> None:
        self.condition.notify_all()


def test_a_turn_sent_once_the_last_one_shows_committed_waits_for_its_claim(llama_engine, directory_factory):
    """The reliability client's order: it sees turns + 1 in the session's state and sends the
    next turn while the last one's bookkeeping (after the commit) still holds the claim."""
    worker = make_worker(llama_engine, directory_factory(), "w1")
    worker.open("acme", "next", DOCUMENT, make_policy("full"), sampling=SAMPLING)
    committed, go, outcome = threading.Event(), threading.Event(), {}
    commit, claims = worker.sessions.commit, worker.sessions.claims
    claims.released = watched = _Watched(claims.released)

    def held_commit(*args, **kwargs):  # the commit is visible; the claim is still held
        commit(*args, **kwargs)
        committed.set()
        go.wait(30)

    worker.sessions.commit = held_commit
    first = threading.Thread(target=lambda: outcome.update(first=worker.turn("acme", "next", QUESTIONS[0], SAMPLING)))
    first.start()
    assert committed.wait(60) and worker.state("acme", "next").turns == 2
    second = threading.Thread(target=lambda: outcome.update(second=worker.turn("acme", "next", QUESTIONS[1], SAMPLING)))
    second.start()
    assert watched.waiting.wait(30)  # waiting for the release, not refused
    go.set()
    first.join(60), second.join(60)
    assert len(outcome["second"].tokens) == SAMPLING.max_new_tokens and outcome["second"].source == "device"
    assert worker.state("acme", "next").turns == 3 and worker.counters["conflicts"] == 0


def test_an_ended_turn_that_never_releases_its_claim_refuses_the_next_after_the_bound(monkeypatch):
    monkeypatch.setattr(claims_module, "ENDING_WAIT_S", 0.05)
    table = claims_module.Claims()
    with table.claimed("acme/s") as claim, claim:
        claim.end()
        with pytest.raises(Conflict, match="in progress"), table.claimed("acme/s"):
            pass
    with table.claimed("acme/s") as claim, claim:  # released: the next one takes it
        assert not claim.ending


def test_a_turn_from_another_thread_is_refused_while_one_runs(llama_engine, directory_factory):
    worker = make_worker(llama_engine, directory_factory(), "w1")
    worker.open("acme", "race", DOCUMENT, make_policy("full"), sampling=SAMPLING)
    running, done = threading.Event(), threading.Event()
    outcome = {}

    def first():  # a turn that is mid-way (one token out) while the second arrives
        stream = worker.stream(TurnRequest("acme", "race", QUESTIONS[0], SamplingParams(max_new_tokens=8)))
        next(iter(stream))
        running.set()
        done.wait(30)
        outcome["first"] = 1 + len(list(stream))

    thread = threading.Thread(target=first)
    thread.start()
    assert running.wait(30)
    with pytest.raises(Conflict, match="in progress"):
        worker.turn("acme", "race", QUESTIONS[1], SAMPLING)
    done.set()
    thread.join()
    assert outcome["first"] == 8
    assert worker.turn("acme", "race", QUESTIONS[2], SAMPLING).source == "device"
    assert worker.counters["rebuilds"] == 0 and worker.counters["conflicts"] == 0


def test_a_turn_cut_by_a_disconnect_is_replayed_as_it_ran(tiny_engine, directory_factory):
    """A client that went away after two tokens: the turn committed what it generated (the last
    token pending; the batch may have run a step or two past what the client read); a rebuild
    replays exactly that, and the next turns equal those of a twin that generated as many."""

    def run(worker, sid, max_new_tokens=50, cut=True) -> int:
        make, recompress = POLICIES["snapkv+h2o"]
        worker.open("acme", sid, DOCUMENT, make(), recompress, SAMPLING)
        stream = worker.stream(TurnRequest("acme", sid, QUESTIONS[0], SamplingParams(max_new_tokens=max_new_tokens)))
        tokens = iter(stream)
        if cut:
            next(tokens), next(tokens)
            stream.close()  # the disconnect
        else:
            list(tokens)
        return stream.report.generated_tokens

    directory = directory_factory()
    first = make_worker(tiny_engine, directory, "w1")
    generated = run(first, "s")
    assert 2 <= generated <= 50 and directory.get("acme", "s").turns == 2  # the cut turn was committed
    plain = make_worker(tiny_engine, directory, "twin")
    run(plain, "twin", max_new_tokens=generated, cut=False)
    want = [tokens for tokens, _ in run_turns(plain, "twin", AFTER)]
    second = make_worker(tiny_engine, directory, "w2")
    got = run_turns(second, "s", AFTER)
    assert got[0][1] == "rebuilt" and [tokens for tokens, _ in got] == want
    assert_same_kv(stored_kv(second, "s"), stored_kv(plain, "twin"))


def test_a_session_whose_first_turn_never_committed_is_refused_then_reopened(llama_engine, directory_factory):
    from kvsnap.store.directory import SessionEntry

    directory = directory_factory()
    directory.create(SessionEntry("acme", "orphan", policy='{"name": "full", "params": {}}'), [])  # opener died
    worker = make_worker(llama_engine, directory, "w1")
    with pytest.raises(Conflict, match="still being opened"):
        worker.turn("acme", "orphan", QUESTIONS[0], SAMPLING)  # never answered without its document
    opened = worker.open("acme", "orphan", DOCUMENT, make_policy("full"), sampling=SAMPLING)
    assert opened.source == "new" and directory.get("acme", "orphan").log_len > len(DOCUMENT)
    with pytest.raises(Conflict, match="already exists"):  # a real session is never replaced
        worker.open("acme", "orphan", DOCUMENT, make_policy("full"), sampling=SAMPLING)


def test_a_stream_closed_before_it_ran_frees_its_session(llama_engine, directory_factory):
    worker = make_worker(llama_engine, directory_factory(), "w1")
    worker.open("acme", "s", DOCUMENT, make_policy("full"), sampling=SAMPLING)
    stream = worker.stream(TurnRequest("acme", "s", QUESTIONS[0], SAMPLING))
    stream.close()
    stream.close()  # idempotent: never frees a later turn's claim
    later = worker.stream(TurnRequest("acme", "s", QUESTIONS[1], SAMPLING))
    stream.close()
    with pytest.raises(Conflict):
        worker.stream(TurnRequest("acme", "s", QUESTIONS[2], SAMPLING))
    assert len(list(later)) == SAMPLING.max_new_tokens


@pytest.mark.parametrize("spec", ["snapkv", "reselect"])
def test_a_session_started_from_a_shared_prefix_survives_kill_wipe_and_drain(
    spec, tiny_engine, directory_factory, twin
):
    """A session whose document came from another session's shared rows (engine/prefixes.py)
    answers after a replica kill, a Redis wipe and a drain like a twin that prefilled it alone."""
    from kvsnap.engine import Engine

    want, want_kv, _ = twin(spec)
    sharing = Engine(tiny_engine.loaded, prefill_chunk=tiny_engine.prefill_chunk, prefix_cache_bytes=64 << 20)
    directory = directory_factory()
    first = make_worker(sharing, directory, "w1")
    first.open("acme", "seed", DOCUMENT, make_policy("full"))  # leaves the document's blocks behind
    make, recompress = POLICIES[spec]
    opened = first.open("acme", "s", DOCUMENT, make(), recompress, SAMPLING)
    assert opened.report.cached_tokens == len(DOCUMENT) // tiny_engine.prefill_chunk * tiny_engine.prefill_chunk > 0
    run_turns(first, "s", BEFORE)
    first.stop()
    second = make_worker(tiny_engine, directory, "w2")  # a replica kill: rebuilt from the log alone
    got = run_turns(second, "s", AFTER[:1])
    wiped = list(directory.client.scan_iter(match=f"{directory.prefix}:*"))
    assert got[0][1] == "rebuilt" and directory.client.delete(*wiped)
    second.heartbeat()  # Redis wiped: the holder writes the session back
    assert second.drain() == 1  # and hands it over
    third = make_worker(tiny_engine, directory, "w3")
    got += run_turns(third, "s", AFTER[1:])
    assert got[1][1] == "imported"
    assert [tokens for tokens, _ in got] == want
    assert_same_kv(stored_kv(third, "s"), want_kv)
