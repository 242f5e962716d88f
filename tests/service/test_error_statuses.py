"""The error matrix, over HTTP and gRPC, before any model work: each error's status on both
protocols, bad requests changing nothing stored, a body over the limit however it is sent,
another tenant's session reading like a missing one, a second concurrent turn refused."""

from __future__ import annotations

import json

import grpc
import pytest
import requests

from kvsnap.errors import (
    Conflict,
    DeadlineExceeded,
    InvalidArgument,
    KvsnapError,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvsnap.service.grpc_stubs import pb2
from kvsnap.service.status import grpc_status, http_status

from .helpers import DOC, create, entry, grpc_stub, md, turn


def test_status_mapping_is_complete():
    errors = [
        InvalidArgument("x"),
        Unauthenticated("x"),
        PermissionDenied("x"),
        NotFound("x"),
        Conflict("x"),
        PayloadTooLarge("x"),
        ResourceExhausted("x"),
        Unavailable("x"),
        DeadlineExceeded("x"),
        KvsnapError("x"),
    ]
    assert [http_status(e) for e in errors] == [400, 401, 403, 404, 409, 413, 429, 503, 504, 500]
    assert [grpc_status(e).name for e in errors] == [
        "INVALID_ARGUMENT",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "NOT_FOUND",
        "ABORTED",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
    ]


@pytest.fixture(scope="module")
def held_session(service):
    assert create(service, "err-held").status_code == 201
    return "err-held"


HTTP_CASES = [
    # (description, method, path, headers key, body, status)
    ("no key", "get", "/v1/sessions/err-held", None, None, 401),
    ("bad key", "get", "/v1/sessions/err-held", "nope", None, 401),
    ("unknown session", "post", "/v1/sessions/ghost/turns", "key-alpha", {"message": "hi"}, 404),
    ("another tenant's session", "post", "/v1/sessions/err-held/turns", "key-beta", {"message": "hi"}, 404),
    ("budget 0", "post", "/v1/sessions", "key-alpha", {"document": DOC, "settings": {"budget": 0}}, 400),
    ("unknown policy", "post", "/v1/sessions", "key-alpha", {"document": DOC, "settings": {"policy": "h3o"}}, 400),
    ("floor of a budget", "post", "/v1/sessions", "key-alpha", {"document": DOC, "settings": {"floor": 64}}, 400),
    ("window > prompt", "post", "/v1/sessions", "key-alpha", {"document": "tiny", "settings": {"window": 64}}, 400),
    (
        "decode policy that cannot evict",
        "post",
        "/v1/sessions",
        "key-alpha",
        {"document": DOC, "settings": {"decode": {"policy": "snapkv"}}},
        400,
    ),
    (
        "decode field of another policy",
        "post",
        "/v1/sessions",
        "key-alpha",
        {"document": DOC, "settings": {"decode": {"policy": "h2o", "history": 5}}},
        400,
    ),
    (
        "reselect with decode eviction",
        "post",
        "/v1/sessions",
        "key-alpha",
        {"document": DOC, "settings": {"policy": "h2o", "recompress": "reselect"}},
        400,
    ),
    ("empty document", "post", "/v1/sessions", "key-alpha", {"document": ""}, 400),
    ("bad session id", "post", "/v1/sessions", "key-alpha", {"session_id": "a/b", "document": DOC}, 400),
    ("max_tokens 0", "post", "/v1/sessions/err-held/turns", "key-alpha", {"message": "q", "max_tokens": 0}, 400),
    ("top_p 2", "post", "/v1/sessions/err-held/turns", "key-alpha", {"message": "q", "top_p": 2}, 400),
    ("empty message", "post", "/v1/sessions/err-held/turns", "key-alpha", {"message": ""}, 400),
    ("unknown field", "post", "/v1/sessions/err-held/turns", "key-alpha", {"message": "q", "bogus": 1}, 400),
    ("too many tokens", "post", "/v1/sessions", "key-alpha", {"document": "x" * 5000}, 413),
    ("body too large", "post", "/v1/sessions", "key-alpha", {"document": "x" * 70_000}, 413),
    (
        "not extending",
        "post",
        "/v1/chat/completions",
        "key-alpha",
        {"messages": [{"role": "user", "content": "other"}]},
        409,
    ),
]


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_errors(service, held_session, case):
    _, method, path, key, body, status = case
    before = entry(service, held_session)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if "chat" in path:
        headers["x-session-id"] = held_session
    response = getattr(requests, method)(f"{service.http}{path}", headers=headers, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]
    after = entry(service, held_session)
    assert (after.version, after.log_len) == (before.version, before.log_len)  # nothing stored changed


def test_chunked_body_is_limited_like_a_declared_one(service, held_session):
    """A body sent without Content-Length (chunked) is counted as it arrives: over the limit is
    413 before any model work; under it the request goes through unchanged."""
    headers = {**service.headers("key-alpha"), "Content-Type": "application/json"}
    url = f"{service.http}/v1/sessions/{held_session}/turns"
    before = entry(service, held_session)

    def chunked(payload: bytes):
        yield from (payload[i : i + 4096] for i in range(0, len(payload), 4096))

    big = json.dumps({"message": "x" * 70_000, "max_tokens": 1}).encode()
    response = requests.post(url, headers=headers, data=chunked(big))
    assert response.request.headers.get("Transfer-Encoding") == "chunked"
    assert response.status_code == 413, response.text
    assert "request body over" in response.json()["error"]["message"]  # the edge's limit, not the token limit
    assert entry(service, held_session).version == before.version
    small = json.dumps({"message": "Next?", "max_tokens": 2}).encode()
    response = requests.post(url, headers=headers, data=chunked(small))
    assert response.status_code == 200, response.text
    assert response.json()["state"]["version"] == before.version + 1


def test_other_tenants_session_reads_like_a_missing_one(service, held_session):
    theirs = requests.get(f"{service.http}/v1/sessions/{held_session}", headers=service.headers("key-beta"))
    missing = requests.get(f"{service.http}/v1/sessions/never-was", headers=service.headers("key-beta"))
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["message"].replace(held_session, "X") == missing.json()["error"]["message"].replace(
        "never-was", "X"
    )


GRPC_CASES = [
    ("no key", "GetSession", lambda: pb2.SessionRef(session_id="err-held"), None, "UNAUTHENTICATED"),
    ("bad key", "GetSession", lambda: pb2.SessionRef(session_id="err-held"), "nope", "UNAUTHENTICATED"),
    ("unknown session", "Turn", lambda: pb2.TurnRequest(session_id="ghost", message="hi"), "key-alpha", "NOT_FOUND"),
    ("another tenant's", "Turn", lambda: pb2.TurnRequest(session_id="err-held", message="hi"), "key-beta", "NOT_FOUND"),
    (
        "budget 0",
        "CreateSession",
        lambda: pb2.CreateSessionRequest(document=DOC, settings=pb2.SessionSettings(policy="snapkv", budget=-1)),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "unknown policy",
        "CreateSession",
        lambda: pb2.CreateSessionRequest(document=DOC, settings=pb2.SessionSettings(policy="h3o")),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "decode settings without a policy",
        "CreateSession",
        lambda: pb2.CreateSessionRequest(
            document=DOC, settings=pb2.SessionSettings(decode=pb2.DecodeSettings(budget=4))
        ),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "reselect with decode eviction",
        "CreateSession",
        lambda: pb2.CreateSessionRequest(
            document=DOC,
            settings=pb2.SessionSettings(recompress="reselect", decode=pb2.DecodeSettings(policy="streaming")),
        ),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "NaN temperature",
        "Turn",
        lambda: pb2.TurnRequest(session_id="err-held", message="q", sampling=pb2.Sampling(temperature=float("nan"))),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "empty message",
        "Turn",
        lambda: pb2.TurnRequest(session_id="err-held", message=""),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "too many tokens",
        "CreateSession",
        lambda: pb2.CreateSessionRequest(document="x" * 5000),
        "key-alpha",
        "INVALID_ARGUMENT",
    ),
    (
        "message too large",
        "CreateSession",
        lambda: pb2.CreateSessionRequest(document="x" * 70_000),
        "key-alpha",
        "RESOURCE_EXHAUSTED",
    ),
]


def test_malformed_grpc_requests_are_invalid_argument_after_the_key_check(service):
    """Bytes that are not the method's message: INVALID_ARGUMENT (grpc itself says UNKNOWN),
    and still UNAUTHENTICATED first without a key."""
    channel = grpc.insecure_channel(service.grpc)
    create = channel.unary_unary("/kvsnap.v1.Kvsnap/CreateSession")
    turn = channel.unary_stream("/kvsnap.v1.Kvsnap/Turn")
    garbage = b"\xff\xff\xff\x0f\x12\x99"
    for call in (lambda: create(garbage, metadata=md()), lambda: list(turn(garbage, metadata=md()))):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        create(garbage)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_errors(service, held_session, case):
    _, method, request, key, code = case
    before = entry(service, held_session)
    call = getattr(grpc_stub(service), method)
    with pytest.raises(grpc.RpcError) as error:
        result = call(request(), metadata=md(key) if key else None)
        list(result) if method == "Turn" else result
    assert error.value.code().name == code and error.value.details()
    after = entry(service, held_session)
    assert (after.version, after.log_len) == (before.version, before.log_len)


def test_second_concurrent_turn_is_rejected_with_409_and_aborted(service, held_session):
    long = turn(service, held_session, "Talk for a while.", max_tokens=2000, stream=True)
    lines = long.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))  # the first turn is generating
    second = turn(service, held_session, "Me too?")
    assert second.status_code == 409 and "in progress" in second.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as error:
        list(grpc_stub(service).Turn(pb2.TurnRequest(session_id=held_session, message="me?"), metadata=md()))
    assert error.value.code() == grpc.StatusCode.ABORTED
    long.close()  # the client goes away: generation stops
