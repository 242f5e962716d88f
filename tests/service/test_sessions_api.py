"""The sessions API end to end, over HTTP and gRPC: a real local Ray Serve app (tiny-llama, 2
replicas), a real redis-server. Three turns equal the in-process engine's; a raw gRPC turn; a
client that goes away; re-selection, decode-time eviction and mixed precision through the service."""

from __future__ import annotations

import json
import time

import requests

from kvsnap.policies import make_policy
from kvsnap.service.grpc_stubs import pb2

from .helpers import DOC, FULL, QUESTIONS, create, entry, grpc_stub, md, reference_answers, turn


def sse_events(response: requests.Response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


def test_three_turns_over_http_equal_the_engine(service, llama_engine):
    want = reference_answers(llama_engine, DOC, QUESTIONS, 6)
    assert create(service, "http-3").status_code == 201
    got = [turn(service, "http-3", QUESTIONS[0]).json()["text"]]
    streamed = sse_events(turn(service, "http-3", QUESTIONS[1], stream=True))
    assert streamed[-1]["text"] == "".join(e["text"] for e in streamed[:-1])
    got.append(streamed[-1]["text"])
    got.append(turn(service, "http-3", QUESTIONS[2]).json()["text"])
    assert got == want


def test_three_turns_over_grpc_equal_the_engine(service, llama_engine):
    want = reference_answers(llama_engine, DOC, QUESTIONS, 6)
    stub = grpc_stub(service)
    state = stub.CreateSession(
        pb2.CreateSessionRequest(session_id="grpc-3", document=DOC, settings=pb2.SessionSettings(policy="full")),
        metadata=md(),
    )
    assert state.turns == 1 and state.logical_len > 0
    got = []
    for q in QUESTIONS:
        chunks = list(
            stub.Turn(
                pb2.TurnRequest(session_id="grpc-3", message=q, sampling=pb2.Sampling(max_tokens=6)), metadata=md()
            )
        )
        assert chunks[-1].done and chunks[-1].state.turns >= 2
        assert sum(len(c.token_ids) for c in chunks) == chunks[-1].completion_tokens  # every token id, once
        got.append("".join(c.text for c in chunks))
    assert got == want
    assert stub.GetSession(pb2.SessionRef(session_id="grpc-3"), metadata=md()).turns == 4


def test_client_disconnect_stops_generation_and_keeps_the_session(service):
    assert create(service, "gone", FULL).status_code == 201
    response = turn(service, "gone", "Go on and on.", max_tokens=3000, stream=True)
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            break
    response.close()
    deadline = time.time() + 20
    while time.time() < deadline and entry(service, "gone").turns < 2:
        time.sleep(0.2)
    state = entry(service, "gone")
    assert state.turns == 2 and state.logical_len < len(DOC) + 1000  # stopped well before max_tokens
    assert turn(service, "gone", "Still there?").status_code == 200


def test_a_raw_grpc_turn_sends_the_message_verbatim(service):
    stub = grpc_stub(service)
    stub.CreateSession(
        pb2.CreateSessionRequest(session_id="grpc-raw", document=DOC, settings=pb2.SessionSettings(policy="full")),
        metadata=md(),
    )
    message = " and then"
    raw = list(stub.Turn(pb2.TurnRequest(session_id="grpc-raw", message=message, raw=True), metadata=md()))[-1]
    templated = list(stub.Turn(pb2.TurnRequest(session_id="grpc-raw", message=message), metadata=md()))[-1]
    # prefilled: the message's tokens and the previous answer's pending one; the template adds its own
    assert raw.prompt_tokens < templated.prompt_tokens
    sampling = pb2.Sampling(max_tokens=25, ignore_eos=True)  # a fixed-length answer (load tests)
    fixed = list(
        stub.Turn(pb2.TurnRequest(session_id="grpc-raw", message=message, raw=True, sampling=sampling), metadata=md())
    )
    assert fixed[-1].completion_tokens == 25 and fixed[-1].finish_reason == "length"


def test_reselect_session_reports_its_reselection_per_turn(service):
    settings = {"policy": "snapkv", "budget": 16, "window": 8, "kernel": 3, "recompress": "reselect"}
    assert create(service, "resel", settings).status_code == 201
    answers = [turn(service, "resel", q).json() for q in QUESTIONS[:2]]
    for a in answers:
        assert a["source"] in ("device", "host") and a["timings"]["reselect_s"] > 0
        assert a["state"]["kept_len"] <= 16 + 8 + 6  # the device holds the selection (+ this turn's answer)
        assert set(a["timings"]) == {"queue_s", "prefill_s", "reselect_s", "decode_s", "ttft_s"}
    metrics = requests.get(f"{service.http}/metrics", headers=service.headers()).text
    count = next(line for line in metrics.splitlines() if line.startswith("kvsnap_reselect_seconds_count"))
    assert float(count.split()[-1]) >= 2
    # an ordinary SnapKV session re-selects from what it kept: no re-selection time
    assert create(service, "not-resel", {"policy": "snapkv", "budget": 16, "window": 8}).status_code == 201
    assert turn(service, "not-resel", QUESTIONS[0]).json()["timings"]["reselect_s"] == 0


def test_decode_time_eviction_over_http_and_grpc_keeps_sessions_within_capacity(service):
    """H2O while decoding over HTTP, StreamingLLM over gRPC: a long answer leaves each session
    holding at most the evictor's capacity, and the session keeps going."""
    settings = {"policy": "snapkv", "budget": 16, "window": 8, "decode": {"policy": "h2o", "budget": 6, "window": 4}}
    assert create(service, "dec-http", settings).status_code == 201
    for q in QUESTIONS[:2]:
        answer = turn(service, "dec-http", q, max_tokens=40).json()
        assert answer["completion_tokens"] > 10 + 1  # longer than the capacity: eviction had to run
        assert answer["state"]["kept_len"] <= 6 + 4
        assert "+decode:h2o(" in answer["state"]["policy"]

    stub = grpc_stub(service)
    decode = pb2.DecodeSettings(policy="streaming", window=6, sinks=2)
    stub.CreateSession(
        pb2.CreateSessionRequest(
            session_id="dec-grpc",
            document=DOC,
            settings=pb2.SessionSettings(policy="snapkv", budget=16, window=8, decode=decode),
        ),
        metadata=md(),
    )
    chunks = list(stub.Turn(pb2.TurnRequest(session_id="dec-grpc", message=QUESTIONS[0]), metadata=md()))
    done = chunks[-1]
    assert done.done and done.state.kept_len <= 2 + 6 and "+decode:streaming(" in done.state.policy


def test_mixed_precision_sessions_over_http_and_grpc(service, llama_engine):
    """``rest``: the rows SnapKV leaves out kept at 4 bits (HTTP) or 2 (gRPC's params map): the
    answers are the in-process engine's with the same policy, and the session holds more bytes
    than one that drops those rows."""
    params = {"budget": 16, "window": 8, "kernel": 3, "rest": "kivi4"}
    mixed = {"policy": "snapkv"} | params
    want = reference_answers(llama_engine, DOC, QUESTIONS[:2], 6, policy=make_policy("snapkv", **params))
    assert create(service, "mixed-http", mixed).status_code == 201
    answers = [turn(service, "mixed-http", q).json() for q in QUESTIONS[:2]]
    assert [a["text"] for a in answers] == want
    assert "rest=kivi4" in answers[-1]["state"]["policy"]
    assert create(service, "dropped-http", mixed | {"rest": "drop"}).status_code == 201
    dropped = [turn(service, "dropped-http", q).json() for q in QUESTIONS[:2]]
    assert answers[-1]["state"]["kept_len"] == dropped[-1]["state"]["kept_len"]  # the same rows at full precision
    assert answers[-1]["state"]["kv_bytes"] > dropped[-1]["state"]["kv_bytes"]
    bad = create(service, "mixed-bad", mixed | {"rest": "kivi3"})
    assert bad.status_code == 400 and "rest must be one of" in bad.text

    stub = grpc_stub(service)
    settings = pb2.SessionSettings(policy="snapkv", budget=16, window=8, params={"rest": "kivi2"})
    request = pb2.CreateSessionRequest(session_id="mixed-grpc", document=DOC, settings=settings)
    stub.CreateSession(request, metadata=md())
    done = list(stub.Turn(pb2.TurnRequest(session_id="mixed-grpc", message=QUESTIONS[0]), metadata=md()))[-1]
    assert done.done and "rest=kivi2" in done.state.policy
