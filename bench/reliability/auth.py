"""Reliability suite, auth phases (bench/reliability/suite.py runs every group; this one alone:
``python bench/reliability/auth.py [--quick] [--phase NAME]``):

- auth:     every route and method without a key and with a wrong one: 401 / UNAUTHENTICATED
            (health exempt); admin routes with a tenant's key: 403, with the admin key and an
            unknown worker id: 404, and no replica drained.
- tenants:  another tenant reads, continues and deletes a session by every route and method:
            answered exactly like a missing id; the session is unchanged.
- logs:     no API key appears in any log (Ray's, Redis's, the app's), once the service stopped.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness and this group

from reliability.common import (
    ADMIN_KEY,
    CLIENT_TIMEOUT_S,
    KEY_A,
    KEY_B,
    WRONG_KEY,
    Client,
    Recorder,
    Sessions,
)
from reliability.local_service import grpc_callable, grpc_code
from reliability.runner import Phase, main


def phase_auth(client: Client, grpc_addr: str, redis_url: str, rec: Recorder) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvsnap.service.auth import ADMIN_PREFIX, OPEN_PATHS
    from kvsnap.service.grpc_stubs import pb2
    from kvsnap.store.directory import SessionDirectory

    schema = requests.get(client.http + "/openapi.json", timeout=10).json()
    routes = 0
    for path, methods in schema["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "rel-000", path)
        for method in methods:
            for key in (None, WRONG_KEY):
                r = client.request("auth", method, concrete, key=key, json={})
                routes += 1
                want_open = path in OPEN_PATHS  # the ingress's list: health and the API docs
                status = None if r is None else r.status_code
                rec.check(
                    status is not None and ((status != 401) if want_open else (status == 401)),
                    f"auth: {method.upper()} {path} with key={key and 'wrong'} answered {status}",
                )
            if path.startswith(ADMIN_PREFIX):  # a tenant's key never opens an admin route
                probes = (("tenant", KEY_A, 403), ("other tenant", KEY_B, 403), ("admin", ADMIN_KEY, 404))
                for who, key, want in probes:  # "rel-000" is no worker's id: 404, nothing drained
                    r = client.request("auth", method, concrete, key=key, json={})
                    status = None if r is None else r.status_code
                    rec.check(status == want, f"auth: {method.upper()} {path}, {who} key: {status}, want {want}")
                    rec.figures["auth"]["admin_route_checks"] = rec.figures["auth"].get("admin_route_checks", 0) + 1
    channel = grpc.insecure_channel(grpc_addr)
    service = pb2.DESCRIPTOR.services_by_name["Kvsnap"]
    for method in service.methods:
        request_cls = getattr(pb2, method.input_type.name)
        for metadata in (None, [("authorization", f"Bearer {WRONG_KEY}")], [("authorization", "Basic abc")]):
            call = grpc_callable(channel, service.full_name, method)
            code = grpc_code(
                lambda call=call, request_cls=request_cls, metadata=metadata: call(
                    request_cls().SerializeToString(), metadata=metadata
                )
            )
            rec.call("auth", f"grpc:{code}", 0.0)
            rec.check(code == "UNAUTHENTICATED", f"auth: gRPC {method.name} without a valid key: {code}")
    loads = SessionDirectory(redis_url).loads()
    rec.check(loads and not any(w["draining"] for w in loads.values()), f"auth: a replica was drained: {loads}")
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    rec.check(health.status == health_pb2.HealthCheckResponse.SERVING, "auth: gRPC health needs no key")
    rec.figures["auth"]["http_route_checks"] = routes
    rec.figures["auth"]["grpc_method_checks"] = 3 * len(service.methods)


def phase_tenants(client: Client, grpc_addr: str, sessions: Sessions, rec: Recorder) -> None:
    import grpc

    from kvsnap.service.grpc_stubs import pb2, pb2_grpc

    sid = sessions.ids[0]
    before = client.request("tenants", "get", f"/v1/sessions/{sid}").json()

    def message(r):
        return r.json()["error"]["message"] if r is not None and r.status_code >= 400 else None

    probes = [
        ("get", "/v1/sessions/{}", None),
        ("post", "/v1/sessions/{}/turns", {"message": "leak?", "max_tokens": 2}),
        ("delete", "/v1/sessions/{}", None),
    ]
    for method, path, body in probes:
        theirs = client.request("tenants", method, path.format(sid), key=KEY_B, json=body)
        missing = client.request("tenants", method, path.format("rel-never"), key=KEY_B, json=body)
        same = (
            theirs is not None
            and missing is not None
            and theirs.status_code == missing.status_code == 404
            and message(theirs).replace(sid, "X") == message(missing).replace("rel-never", "X")
        )
        rec.check(
            same,
            f"tenants: {method.upper()} {path} on another tenant's session differs from a missing one: "
            f"{theirs is not None and (theirs.status_code, theirs.text)} vs "
            f"{missing is not None and (missing.status_code, missing.text)}",
        )
    stub = pb2_grpc.KvsnapStub(grpc.insecure_channel(grpc_addr))
    md = [("authorization", f"Bearer {KEY_B}")]
    for name, request in (
        ("GetSession", pb2.SessionRef(session_id=sid)),
        ("DeleteSession", pb2.SessionRef(session_id=sid)),
        ("Turn", pb2.TurnRequest(session_id=sid, message="leak?", sampling=pb2.Sampling(max_tokens=2))),
    ):

        def call(name=name, request=request):
            out = getattr(stub, name)(request, metadata=md, timeout=CLIENT_TIMEOUT_S)
            return list(out) if name == "Turn" else out

        code = grpc_code(call)
        rec.call("tenants", f"grpc:{code}", 0.0)
        rec.check(code == "NOT_FOUND", f"tenants: gRPC {name} on another tenant's session: {code}")
    # the OpenAI route with the id: the other tenant gets a session of its own under that id
    r = client.request(
        "tenants",
        "post",
        "/v1/completions",
        key=KEY_B,
        headers={"x-session-id": sid},
        json={"prompt": "Who are you?", "max_tokens": 2},
    )
    rec.check(r is not None and r.status_code == 200 and sessions.docs[sid][:20] not in r.text, "tenants: completions")
    after = client.request("tenants", "get", f"/v1/sessions/{sid}").json()
    rec.check(
        (after["version"], after["turns"]) == (before["version"], before["turns"]), "tenants: the session changed"
    )
    client.request("tenants", "delete", f"/v1/sessions/{sid}", key=KEY_B)  # B's own session under that id
    tenants_documents(client, stub, sessions, rec)


def tenants_documents(client: Client, stub, sessions: Sessions, rec: Recorder) -> None:
    """Another tenant and a registered document: by id it is a missing one (HTTP and gRPC); by
    its text, the other tenant registers a document of its own, new, under another id."""
    from kvsnap.service.grpc_stubs import pb2

    doc_id, missing_id = sessions.document_ids[0], "doc-" + "0" * 32
    probes = [
        ("get", "/v1/documents/{}", None),
        ("delete", "/v1/documents/{}", None),
        ("post", "/v1/sessions", lambda i: {"document_id": i}),
    ]

    def answer(method, path, body, i):  # status and message, the id in it made anonymous
        r = client.request("tenants", method, path.format(i), key=KEY_B, json=body and body(i))
        return None if r is None else (r.status_code, r.text.replace(i, "X"))

    for method, path, body in probes:
        theirs, missing = answer(method, path, body, doc_id), answer(method, path, body, missing_id)
        rec.check(
            theirs is not None and theirs == missing and theirs[0] == 404,
            f"tenants: {method.upper()} {path} on another tenant's document differs from a missing one: "
            f"{theirs} vs {missing}",
        )
    listed = client.request("tenants", "get", "/v1/documents", key=KEY_B)
    rec.check(listed is not None and doc_id not in listed.text, "tenants: another tenant lists the document")
    md = [("authorization", f"Bearer {KEY_B}")]
    for name, request in (
        ("GetDocument", pb2.DocumentRef(document_id=doc_id)),
        ("DeleteDocument", pb2.DocumentRef(document_id=doc_id)),
        ("CreateSession", pb2.CreateSessionRequest(document_id=doc_id)),
    ):
        code = grpc_code(lambda name=name, request=request: getattr(stub, name)(request, metadata=md, timeout=30))
        rec.call("tenants", f"grpc:{code}", 0.0)
        rec.check(code == "NOT_FOUND", f"tenants: gRPC {name} on another tenant's document: {code}")
    theirs = client.request("tenants", "post", "/v1/documents", key=KEY_B, json={"document": sessions.shared[0]})
    own = theirs is not None and theirs.status_code == 201 and theirs.json()["new"]
    rec.check(own and theirs.json()["document_id"] != doc_id, "tenants: the same text is not the other's own document")
    if own:
        client.request("tenants", "delete", f"/v1/documents/{theirs.json()['document_id']}", key=KEY_B)
    mine = client.request("tenants", "get", f"/v1/documents/{doc_id}")
    rec.check(mine is not None and mine.status_code == 200, "tenants: the owner lost its document")


def phase_logs(data_dir: Path, rec: Recorder) -> None:
    """No API key in any log: Ray's session logs, the embedded Redis, the app's data dir."""
    roots = [Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs", data_dir]
    scanned, hits = 0, []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and path.suffix not in (".safetensors", ".aof", ".rdb"):
                scanned += 1
                text = path.read_bytes()
                for key in (KEY_A, KEY_B, WRONG_KEY, ADMIN_KEY):
                    if key.encode() in text:
                        hits.append(str(path))
    rec.figures["logs"] = {"files_scanned": scanned, "files_with_a_key": len(hits)}
    rec.check(not hits, f"logs: API keys found in {hits[:5]}")


PHASES = [
    Phase("auth", lambda s: phase_auth(s.client, s.grpc_addr, s.redis.url, s.rec), sessions=False),
    Phase("tenants", lambda s: phase_tenants(s.client, s.grpc_addr, s.sessions, s.rec)),
    Phase("logs", lambda s: phase_logs(s.data_dir, s.rec), sessions=False, after_stop=True),
]


if __name__ == "__main__":
    sys.exit(main(PHASES, description=__doc__))
