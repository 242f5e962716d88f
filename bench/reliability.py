"""Reliability and security suite: faults, overload and hostile input against a real local
service, with nothing lost.

One local Ray, one redis-server (started here, so that this script can crash, restart and
wipe it) and one Serve app: tiny-llama, 2 worker replicas, a device and a host tier of 1 MiB
each and a disk tier, so sessions spread over all three. Half the sessions use the service's
default policy, SnapKV (budget 128, window 16: their caches really are compressed), half policy
``full``; all decode greedily, so an uninterrupted in-process twin tells exactly what each turn
must answer (a rebuild replays each turn's compression, so a SnapKV session rebuilt after a
kill, a wipe or a corrupted blob must answer like its twin too). After every disruptive phase
each session is asked its next question and must answer that (a session that cannot is
*lost*); the figures count each policy apart.

Phases, in order:

- auth:        every route and method without a key and with a wrong one: 401 / UNAUTHENTICATED
               (health exempt); admin routes with a tenant's key: 403, with the admin key and an
               unknown worker id: 404, and no replica drained.
- tenants:     another tenant reads, continues and deletes a session by every route and
               method: answered exactly like a missing id; the session is unchanged.
- fuzz_http:   schemathesis over the whole OpenAPI schema: no 5xx.
- fuzz_grpc:   malformed bytes, truncated, oversized and hostile-valued messages to every
               method: only client-error statuses (never INTERNAL / UNKNOWN / UNAVAILABLE).
- disconnect:  streamed turns cut after their first token: the session answers its next turn.
- overload:    twice the service's capacity in concurrent turns: excess answered 429 with
               Retry-After, accepted turns within their timeout, tiers within their budgets,
               no replica lost, and a turn right after answers.
- corrupt:     the disk tier's session files truncated or garbled: detected, rebuilt from the
               token log, right answers.
- kill:        a worker replica killed every few seconds while the sessions converse: every
               turn succeeds or fails with a retryable 503 / 429, none past its timeout.
- redis:       redis-server crashed (SIGKILL) mid-load and restarted over its data, then
               restarted empty: requests fail fast with 503 while it is down; afterwards the
               workers re-register what they hold and no session is lost.
- logs:        no API key appears in any log (Ray's, Redis's, the app's).

Prints a table, writes reliability.json into --out, exits 1 when any check failed.
``--quick`` is the bounded version the tests run (a few minutes); the default is the long one.

Usage: python bench/reliability.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from kvsnap.service.config import ray_environment

ray_environment()  # the Ray Serve data path `kvsnap serve` uses, set before Ray is imported

from kvsnap.service.app import wait_for_workers  # noqa: E402
from kvsnap.service.auth import OPEN_PATHS  # noqa: E402

QUICK = dict(
    sessions=20, turns_kill=3, kill_every_s=6.0, kill_duration_s=25, redis_down_s=4, fuzz_examples=5, grpc_cases=160
)
LONG = dict(
    sessions=40, turns_kill=8, kill_every_s=5.0, kill_duration_s=120, redis_down_s=10, fuzz_examples=40, grpc_cases=2000
)
QUESTIONS_BEYOND_KILL = 12  # what the other phases ask of one session at most (overload 3, verifications 5, redis 4)
QUESTIONS = [
    "What is the code word?",
    "Who wrote it?",
    "Where was it found?",
    "Say it again.",
    "What comes next?",
    "Is that all?",
    "Why does it matter?",
    "Summarise it.",
]
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 30  # the service's; a client waits a little longer
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 15
RETRYABLE = {429, 503}
KEY_A, KEY_B = "rel-" + os.urandom(12).hex(), "rel-" + os.urandom(12).hex()
ADMIN_KEY = "rel-admin-" + os.urandom(12).hex()
# the service's default policy (SnapKV) for this suite: small enough that ~800-token documents compress
DEFAULTS = dict(policy="snapkv", budget=128, window=16, kernel=7, pooling="max", spans=False)
WRONG_KEY = "rel-wrong-" + os.urandom(12).hex()
FUZZ_SESSION = "rel-fuzz"  # the fuzzers may talk to this one; the verified sessions are out of their reach


# -- recording every request -------------------------------------------------------------------


class Recorder:
    """Every request of every phase: status and latency; checks that failed, with why."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: dict[str, list[tuple[str, float]]] = defaultdict(list)
        self.failures: list[str] = []
        self.figures: dict[str, dict] = defaultdict(dict)

    def call(self, phase: str, status, latency_s: float) -> None:
        with self.lock:
            self.calls[phase].append((str(status), latency_s))

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            with self.lock:
                self.failures.append(what)
            print(f"  FAILED: {what}", flush=True)
        return ok

    def summary(self) -> dict:
        out = {}
        for phase, calls in self.calls.items():
            out[phase] = {
                "requests": len(calls),
                "by_status": dict(sorted(Counter(s for s, _ in calls).items())),
                "max_latency_s": round(max(t for _, t in calls), 3),
            } | self.figures.get(phase, {})
        for phase, figures in self.figures.items():
            out.setdefault(phase, figures)
        return out


class Client:
    def __init__(self, http: str, rec: Recorder):
        self.http = http
        self.rec = rec
        self.session = requests.Session()

    def request(
        self, phase: str, method: str, path: str, key: str | None = KEY_A, **kwargs
    ) -> requests.Response | None:
        headers = kwargs.pop("headers", {}) | ({"Authorization": f"Bearer {key}"} if key else {})
        t0 = time.perf_counter()
        try:
            r = requests.request(method, self.http + path, headers=headers, timeout=CLIENT_TIMEOUT_S, **kwargs)
        except requests.Timeout:
            self.rec.call(phase, "client-timeout", time.perf_counter() - t0)
            self.rec.check(False, f"{phase}: {method} {path} hung past {CLIENT_TIMEOUT_S}s")
            return None
        except requests.ConnectionError:
            self.rec.call(phase, "connection-error", time.perf_counter() - t0)
            return None
        self.rec.call(phase, r.status_code, time.perf_counter() - t0)
        return r


# -- the sessions and what they must answer ------------------------------------------------------


class Sessions:
    """The verified sessions: documents, the questions in order, the reference answers, and
    how many turns each has completed (as the service's ``turns`` counts them, minus the open)."""

    def __init__(self, n: int, turns: int, seed: int = 0):
        rng = random.Random(seed)
        words = ["amber", "basalt", "cedar", "dune", "ember", "fjord", "glacier", "harbor", "iris", "kelp"]
        self.ids = [f"rel-{i:03d}" for i in range(n)]
        self.docs = {
            sid: f"Document {sid}. The code word is {rng.choice(words)}-{rng.randint(100, 999)}. "
            + " ".join(rng.choice(words) for _ in range(120))  # ~800 tokens: 2 sessions fill a 1 MiB tier
            for sid in self.ids
        }
        self.questions = {
            sid: [QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(turns)] for i, sid in enumerate(self.ids)
        }
        # even sessions: the service's default policy (they open with no settings); odd: full KV
        self.policy = {sid: "snapkv" if i % 2 == 0 else "full" for i, sid in enumerate(self.ids)}
        self.answers: dict[str, list[str]] = {}
        self.done = dict.fromkeys(self.ids, 0)
        self.lock = threading.Lock()

    def reference(self) -> None:
        """What an undisturbed service answers: an uninterrupted in-process twin of each session,
        same policy, template, stop string and prefill chunk, greedy."""
        from kvsnap.engine import Engine, SamplingParams, load_model
        from kvsnap.engine.sampling import cut_at_stop
        from kvsnap.policies import make_policy
        from kvsnap.service.config import ServiceConfig
        from kvsnap.service.template import TURN_MARKER, encode_messages

        engine = Engine(load_model("tiny-llama"), prefill_chunk=ServiceConfig().prefill_chunk)
        tok = engine.tokenizer
        snapkv = {k: v for k, v in DEFAULTS.items() if k != "policy"}
        sampling = SamplingParams(max_new_tokens=MAX_TOKENS, stop=(TURN_MARKER,))
        for sid in self.ids:
            policy = make_policy("snapkv", **snapkv) if self.policy[sid] == "snapkv" else make_policy("full")
            session = engine.new_session(policy)
            engine.prefill(session, encode_messages(tok, [{"role": "document", "content": self.docs[sid]}], True))
            self.answers[sid] = [
                cut_at_stop(
                    engine.turn(session, encode_messages(tok, [{"role": "user", "content": q}], False), sampling).text,
                    (TURN_MARKER,),
                )
                for q in self.questions[sid]
            ]
            if self.policy[sid] == "snapkv" and session.kept_len >= session.logical_len:
                raise SystemExit(f"{sid}: the SnapKV twin kept every row; the suite's documents are too short")


def open_all(client: Client, sessions: Sessions, rec: Recorder) -> None:
    """Open the verified sessions, and the one the fuzzers may use."""
    docs = dict(sessions.docs) | {FUZZ_SESSION: "A document for the fuzzers."}
    for sid, doc in docs.items():
        body = {"session_id": sid, "document": doc}
        if sessions.policy.get(sid, "full") == "full":
            body["settings"] = {"policy": "full"}  # the others take the service's default (SnapKV)
        r = client.request("setup", "post", "/v1/sessions", json=body)
        if r is None or r.status_code != 201:
            raise SystemExit(f"could not open {sid}: {None if r is None else r.text}")
        if sid in sessions.policy:
            got = r.json()["policy"].split("(")[0]
            rec.check(got == sessions.policy[sid], f"setup: {sid} opened with {got}, want {sessions.policy[sid]}")


def one_turn(client: Client, sessions: Sessions, sid: str, phase: str, rec: Recorder) -> str:
    """Ask ``sid`` its next question once: 'ok', 'wrong', 'retry' (a retryable failure; the
    turn did not happen) or 'error'. A failure after which the service counts the turn as done
    (it committed, then the answer was lost on the way) counts as done: with greedy decoding
    (a rebuild replays the turns as they ran) the stored answer is the reference one."""
    k = sessions.done[sid]
    if k >= len(sessions.questions[sid]):
        rec.check(False, f"{phase}: {sid} ran out of questions (the suite asks too much of one session)")
        return "finished"
    r = client.request(
        phase,
        "post",
        f"/v1/sessions/{sid}/turns",
        json={"message": sessions.questions[sid][k], "max_tokens": MAX_TOKENS},
    )
    if r is not None and r.status_code == 200:
        sessions.done[sid] += 1
        count_source(rec, phase, sessions.policy[sid], r.json()["source"])
        ok = r.json()["text"] == sessions.answers[sid][k]
        rec.check(
            ok,
            f"{phase}: {sid} [{sessions.policy[sid]}] turn {k + 1} answered {r.json()['text']!r}, "
            f"want {sessions.answers[sid][k]!r}",
        )
        return "ok" if ok else "wrong"
    if r is not None and r.status_code not in RETRYABLE:
        rec.check(False, f"{phase}: {sid} turn {k + 1}: non-retryable {r.status_code} {r.text[:200]}")
        return "error"
    if r is not None and r.status_code == 429:
        rec.check("Retry-After" in r.headers, f"{phase}: 429 without Retry-After")
    state = client.request(phase, "get", f"/v1/sessions/{sid}")
    if state is not None and state.status_code == 200 and state.json()["turns"] > k + 1:
        sessions.done[sid] += 1  # committed before the failure
        rec.figures[phase]["committed_unacknowledged"] = rec.figures[phase].get("committed_unacknowledged", 0) + 1
    return "retry"


def count_source(rec: Recorder, phase: str, policy: str, source: str) -> None:
    """Where the KV of each checked answer came from, per policy (a "rebuilt" one was replayed)."""
    with rec.lock:
        counts = rec.figures[phase].setdefault("sources_by_policy", {}).setdefault(policy, {})
        counts[source] = counts.get(source, 0) + 1


def verify_all(client: Client, sessions: Sessions, phase: str, rec: Recorder, patience_s: float = 60) -> dict:
    """Every session answers its next question right (retrying retryable failures)."""
    sources, by_session = Counter(), {}
    lost = []
    for sid in sessions.ids:
        deadline = time.time() + patience_s
        while True:
            k = sessions.done[sid]
            if k >= len(sessions.questions[sid]):
                rec.check(False, f"{phase}: {sid} ran out of questions (the suite asks too much of one session)")
                break
            q = sessions.questions[sid][k]
            r = client.request(
                phase, "post", f"/v1/sessions/{sid}/turns", json={"message": q, "max_tokens": MAX_TOKENS}
            )
            if r is not None and r.status_code == 200:
                sessions.done[sid] += 1
                sources[r.json()["source"]] += 1
                count_source(rec, phase, sessions.policy[sid], r.json()["source"])
                by_session[sid] = r.json()["source"]
                if r.json()["text"] != sessions.answers[sid][k]:
                    lost.append(sid)
                    rec.check(
                        False,
                        f"{phase}: {sid} [{sessions.policy[sid]}] answered {r.json()['text']!r}, "
                        f"want {sessions.answers[sid][k]!r}",
                    )
                break
            if time.time() > deadline or (r is not None and r.status_code not in RETRYABLE):
                lost.append(sid)
                status = None if r is None else r.status_code
                rec.check(False, f"{phase}: {sid} [{sessions.policy[sid]}] did not answer ({status})")
                break
            time.sleep(1)
    rec.figures[phase]["verified_sessions"] = len(sessions.ids) - len(lost)
    rec.figures[phase]["sessions_lost"] = len(lost)
    rec.figures[phase]["verify_sources"] = dict(sources)
    rec.figures[phase]["by_policy"] = {
        policy: {
            "verified": sum(1 for sid in sessions.ids if sessions.policy[sid] == policy and sid not in lost),
            "lost": sum(1 for sid in lost if sessions.policy[sid] == policy),
            "rebuilt": sum(1 for sid, src in by_session.items() if sessions.policy[sid] == policy and src == "rebuilt"),
        }
        for policy in sorted(set(sessions.policy.values()))
    }
    return {"lost": lost, "sources": sources, "by_session": by_session}


# -- phases --------------------------------------------------------------------------------------


def phase_auth(client: Client, grpc_addr: str, redis_url: str, rec: Recorder) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvsnap.service.auth import ADMIN_PREFIX
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
            call = _grpc_callable(channel, service.full_name, method)
            code = _grpc_code(
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

        code = _grpc_code(call)
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


def phase_fuzz_http(client: Client, out_dir: Path, examples: int, rec: Recorder) -> None:
    """schemathesis over every operation of the OpenAPI schema; the only check: no 5xx."""
    report = (out_dir / "schemathesis-junit.xml").resolve()
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        client.http + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(examples),
        "--seed",
        "7",
        "--header",
        f"Authorization: Bearer {KEY_A}",
        "--request-timeout",
        str(CLIENT_TIMEOUT_S),
        "--workers",
        "1",  # hypothesis describes strategies with ast, which is not thread-safe on Python 3.11
        "--no-color",
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
        "--phases",
        "examples,coverage,fuzzing",
        "--exclude-path",
        "/v1/admin/workers/{worker_id}/drain",  # drains a replica: exercised by the service tests
        "--suppress-health-check",
        "all",
        "--generation-database",
        "none",
    ]
    t0 = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="kvsnap-schemathesis-")  # its caches land in the working directory
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False, cwd=scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    text = run.stdout + run.stderr
    cases = sum(int(n) for n in re.findall(r"(\d+) generated", text)) or None
    server_errors = len(re.findall(r"Server error", text))
    rec.figures["fuzz_http"] = {
        "exit_code": run.returncode,
        "test_cases": cases,
        "server_errors": server_errors,
        "seconds": round(elapsed, 1),
    }
    rec.check(run.returncode == 0, f"fuzz_http: schemathesis failed (exit {run.returncode}):\n{text[-3000:]}")
    (out_dir / "schemathesis.log").write_text(text)


def phase_fuzz_grpc(grpc_addr: str, cases: int, max_bytes: int, rec: Recorder) -> None:
    import grpc

    from kvsnap.service.grpc_stubs import pb2

    allowed = {
        "OK",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "NOT_FOUND",
        "ABORTED",
        "FAILED_PRECONDITION",
        "OUT_OF_RANGE",
    }
    channel = grpc.insecure_channel(grpc_addr, options=[("grpc.max_send_message_length", 4 * max_bytes)])
    service = pb2.DESCRIPTOR.services_by_name["Kvsnap"]
    methods = list(service.methods)
    rng = random.Random(11)
    md = [("authorization", f"Bearer {KEY_A}")]
    codes = Counter()
    kinds = Counter()
    for i in range(cases):
        method = methods[i % len(methods)]
        request_cls = getattr(pb2, method.input_type.name)
        kind = ("random bytes", "truncated", "hostile values", "oversized")[i % 4]
        if kind == "random bytes":
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
        elif kind == "truncated":
            full = _hostile(request_cls, rng).SerializeToString()
            payload = full[: rng.randint(0, max(0, len(full) - 1))]
        elif kind == "hostile values":
            payload = _hostile(request_cls, rng).SerializeToString()
        else:
            payload = b"\x12" + _varint(max_bytes + 10) + b"x" * (max_bytes + 10)  # field 2, length-delimited
        call = _grpc_callable(channel, service.full_name, method)
        code = _grpc_code(lambda call=call, payload=payload: call(payload, metadata=md, timeout=CLIENT_TIMEOUT_S))
        codes[code] += 1
        kinds[kind] += 1
        rec.call("fuzz_grpc", f"grpc:{code}", 0.0)
        rec.check(code in allowed, f"fuzz_grpc: {method.name} with {kind} answered {code}")
    rec.figures["fuzz_grpc"] = {"cases": cases, "by_kind": dict(kinds), "by_code": dict(codes)}


def _hostile(request_cls, rng: random.Random):
    """A message of ``request_cls`` with every field set to something a server must survive."""
    strings = [
        "",
        "a" * 10_000,
        "../../etc/passwd",
        "\x00\x01",
        "🙂" * 500,
        FUZZ_SESSION,
        "rel-never",
        "full",
        "h2o",
        "reselect",
    ]
    ints = [0, -1, 1, 2**31 - 1, -(2**31), 7, 4096]
    floats = [0.0, -1.0, float("nan"), float("inf"), 1e30, 0.5]
    msg = request_cls()
    for field in msg.DESCRIPTOR.fields:
        if field.message_type is not None:
            if not field.is_repeated:
                sub = getattr(msg, field.name)
                sub.CopyFrom(_hostile(type(sub), rng))
            continue
        pick = {
            field.TYPE_STRING: lambda: rng.choice(strings),
            field.TYPE_BOOL: lambda: rng.random() < 0.5,
            field.TYPE_FLOAT: lambda: rng.choice(floats),
            field.TYPE_DOUBLE: lambda: rng.choice(floats),
        }.get(field.type, lambda: rng.choice(ints))
        if field.is_repeated:
            getattr(msg, field.name).extend(pick() for _ in range(rng.randint(0, 3)))
        else:
            setattr(msg, field.name, pick())
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _grpc_callable(channel, service_name: str, method):
    path = f"/{service_name}/{method.name}"
    if method.server_streaming:
        stream = channel.unary_stream(path)
        return lambda payload, **kw: list(stream(payload, **kw))
    return channel.unary_unary(path)


def _grpc_code(call) -> str:
    import grpc

    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def phase_disconnect(client: Client, sessions: Sessions, rec: Recorder, n: int) -> None:
    """Streamed turns cut after their first token; each session then answers a turn."""
    cut = sessions.ids[-n:]
    for sid in cut:
        state = client.request("disconnect", "get", f"/v1/sessions/{sid}").json()
        r = requests.post(
            f"{client.http}/v1/sessions/{sid}/turns",
            headers={"Authorization": f"Bearer {KEY_A}"},
            json={"message": "Go on and on.", "max_tokens": 1000, "stream": True},
            stream=True,
            timeout=CLIENT_TIMEOUT_S,
        )
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                break
        r.close()
        deadline = time.time() + 20
        while time.time() < deadline:
            after = client.request("disconnect", "get", f"/v1/sessions/{sid}").json()
            if after["turns"] > state["turns"]:
                break
            time.sleep(0.2)
        stopped = after["turns"] == state["turns"] + 1 and after["logical_len"] < state["logical_len"] + 1000
        rec.check(stopped, f"disconnect: {sid} did not stop generating or commit the cut turn ({state} -> {after})")
        follow = client.request(
            "disconnect", "post", f"/v1/sessions/{sid}/turns", json={"message": "Still there?", "max_tokens": 3}
        )
        rec.check(follow is not None and follow.status_code == 200, f"disconnect: {sid} did not answer after the cut")
    # these sessions now hold answers nobody can predict: they leave the verified set
    for sid in cut:
        sessions.ids.remove(sid)
    rec.figures["disconnect"]["streams_cut"] = n


def phase_overload(client: Client, sessions: Sessions, cfg, rec: Recorder) -> None:
    capacity = cfg.replicas * cfg.max_ongoing_requests + cfg.max_queued_requests
    load = 2 * capacity
    sids = sessions.ids[:load]
    replicas_before = _worker_actor_names()
    t0 = time.perf_counter()
    outcomes = Counter()
    with ThreadPoolExecutor(load) as pool:
        for _ in range(2):  # two waves of twice the capacity at once
            outcomes.update(pool.map(lambda sid: one_turn(client, sessions, sid, "overload", rec), sids))
    elapsed = time.perf_counter() - t0
    statuses = Counter(s for s, _ in rec.calls["overload"])
    rec.check(statuses.get("429", 0) > 0, f"overload: twice the capacity ({load}) drew no 429 ({dict(statuses)})")
    rec.check(statuses.get("200", 0) > 0, "overload: nothing was served")
    slow = [t for s, t in rec.calls["overload"] if s == "429" and t > 5]
    rec.check(not slow, f"overload: {len(slow)} rejections took more than 5 s")
    metrics = client.request("overload", "get", "/metrics").text
    budgets = {"device": cfg.device_tier_mib << 20, "host": cfg.host_tier_mib << 20, "disk": cfg.disk_tier_mib << 20}
    # a put stores first and then demotes: a tier may hold one session more for a moment
    largest = max(client.request("overload", "get", f"/v1/sessions/{sid}").json()["kv_bytes"] for sid in sids)
    for tier, budget in budgets.items():
        held = [float(v) for v in re.findall(rf'kvsnap_kv_bytes\{{[^}}]*tier="{tier}"[^}}]*\}} ([0-9.e+]+)', metrics)]
        over = [v for v in held if v > budget + largest]
        rec.check(not over, f"overload: {tier} tier over its budget: {over} > {budget} + one session ({largest})")
    rec.check(_worker_actor_names() == replicas_before, "overload: a worker replica died or restarted")
    t1 = time.perf_counter()
    recovered = one_turn(client, sessions, sids[0], "overload-after", rec)
    rec.figures["overload"] |= {
        "capacity": capacity,
        "concurrent": load,
        "seconds": round(elapsed, 1),
        "recovered_turn": recovered,
        "recovered_turn_s": round(time.perf_counter() - t1, 3),
    }


def phase_corrupt(client: Client, sessions: Sessions, data_dir: Path, redis_url: str, rec: Recorder) -> None:
    """Truncate half of the verified sessions' files in their holder's disk tier, garble the other half."""
    from kvsnap.store.directory import SessionDirectory

    directory = SessionDirectory(redis_url)
    files = {}
    for sid in sessions.ids:
        entry = directory.get("alpha", sid)
        # the holder's file (a replica that gave a session up may keep a stale copy until LRU drops it)
        found = list((data_dir / "disk" / entry.owner).glob(f"alpha_{sid}-*.safetensors")) if entry else []
        if entry is not None and entry.tier == "disk" and found:
            files[sid] = found[0]
    rec.check(len(files) >= 2, f"corrupt: only {len(files)} verified sessions in the disk tier (tiers too large?)")
    for i, path in enumerate(files.values()):
        data = path.read_bytes()
        if i % 2:
            path.write_bytes(data[: len(data) // 2])  # truncated
        else:
            middle = len(data) // 2
            path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :])
    result = verify_all(client, sessions, "corrupt", rec)
    rebuilt = sorted(sid for sid in files if result["by_session"].get(sid) == "rebuilt")
    rec.figures["corrupt"] |= {"files_corrupted": len(files), "rebuilt": len(rebuilt)}
    rec.check(rebuilt == sorted(files), f"corrupt: corrupted {sorted(files)}, rebuilt {rebuilt}")


def phase_kill(
    client: Client, sessions: Sessions, every_s: float, duration_s: float, turns: int, rec: Recorder
) -> None:
    import ray

    stop = threading.Event()
    kills = []

    def killer():
        """Every few seconds, one replica of the two, never the last one running (the fault
        model: losing one of N replicas; Serve restarts it)."""
        rng = random.Random(5)
        wait = every_s / 2
        while not stop.wait(wait):
            wait = every_s
            names = sorted(_worker_actor_names())
            if _running_replicas() >= 2:
                name = rng.choice(names)
                try:
                    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                    kills.append(name)
                except ValueError:
                    pass

    def converse(sid):
        """``turns`` turns spread over the phase, so that kills land between and during them."""
        goal = sessions.done[sid] + turns
        pace = random.Random(sid)
        while not stop.is_set() and sessions.done[sid] < goal:
            outcome = one_turn(client, sessions, sid, "kill", rec)
            stop.wait(0.5 if outcome == "retry" else duration_s / (turns + 1) * pace.uniform(0.5, 1.2))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    deadline = time.time() + duration_s
    with ThreadPoolExecutor(len(sessions.ids)) as pool:
        futures = [pool.submit(converse, sid) for sid in sessions.ids]
        while time.time() < deadline and not all(f.done() for f in futures):
            time.sleep(0.5)
        stop.set()
        for f in futures:
            f.result()
    thread.join()
    statuses = Counter(s for s, _ in rec.calls["kill"])
    bad = {s: n for s, n in statuses.items() if s not in ("200", "429", "503")}
    rec.check(not bad, f"kill: turns failed with non-retryable statuses {bad}")
    rec.check(wait_for_workers(2), "kill: the worker replicas did not all come back within 120 s")
    rec.figures["kill"]["replicas_killed"] = len(kills)
    verify_all(client, sessions, "kill-verify", rec, patience_s=90)


def phase_redis(client: Client, sessions: Sessions, redis, down_s: float, rec: Recorder) -> None:
    # 1. a crash mid-load, restarted over its data
    stop = threading.Event()

    def converse(sid):
        goal = sessions.done[sid] + 4
        while not stop.is_set() and sessions.done[sid] < goal:
            if one_turn(client, sessions, sid, "redis-down", rec) == "retry":
                time.sleep(0.3)

    created = []
    with ThreadPoolExecutor(4) as pool:
        for sid in sessions.ids[:4]:
            pool.submit(converse, sid)
        time.sleep(1)
        redis.kill()
        down_at = time.perf_counter()
        for i in range(3):  # a new session needs the directory: it must fail, fast and clearly
            sid = f"rel-outage-{i}"
            r = client.request("redis-down", "post", "/v1/sessions", json={"session_id": sid, "document": "Outage."})
            created.append((sid, None if r is None else r.status_code))
            time.sleep(down_s / 4)
        time.sleep(max(0.0, down_s - (time.perf_counter() - down_at)))
        redis.start()
        rec.figures["redis-down"]["down_s"] = round(time.perf_counter() - down_at, 1)
        time.sleep(2)
        stop.set()
    failing = [t for s, t in rec.calls["redis-down"] if s == "503"]
    served = sum(1 for s, _ in rec.calls["redis-down"] if s == "200")
    rec.figures["redis-down"] |= {
        "failed_503": len(failing),
        "max_503_latency_s": round(max(failing, default=0.0), 3),
        "served_while_down_or_after": served,
        "creates_while_down": [code for _, code in created],
    }
    rec.check(all(code == 503 for _, code in created), f"redis: creating a session while Redis was down: {created}")
    rec.check(max(failing, default=0) < 5, f"redis: failing requests took up to {max(failing, default=0):.1f}s")
    statuses = Counter(s for s, _ in rec.calls["redis-down"])
    bad = {s: n for s, n in statuses.items() if s not in ("200", "201", "429", "503")}
    rec.check(not bad, f"redis: statuses other than 200/503 around the outage: {bad}")
    for sid, _ in created:  # nothing half-created
        r = client.request("redis-down", "get", f"/v1/sessions/{sid}")
        rec.check(r is not None and r.status_code == 404, f"redis: {sid} exists after a failed create")
    verify_all(client, sessions, "redis-restarted", rec)
    # 2. restarted empty: every worker re-registers what it holds on its next heartbeat
    redis.stop()
    shutil.rmtree(redis.data_dir)
    redis.start()
    time.sleep(6)  # a few heartbeats (2 s each)
    verify_all(client, sessions, "redis-wiped", rec, patience_s=30)


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


# -- service plumbing ----------------------------------------------------------------------------


def _worker_actor_names() -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Worker#" in a["name"]}


def _running_replicas() -> int:
    from ray import serve

    return serve.status().applications["kvsnap"].deployments["Worker"].replica_states.get("RUNNING", 0)


def start(data_dir: Path):
    """Redis (this script's own, to crash and wipe), local Ray and the app, via the bench harness."""
    import ray
    from harness import start_service

    from kvsnap.service.config import PolicyDefaults
    from kvsnap.store.redis_server import EmbeddedRedis

    redis = EmbeddedRedis(data_dir / "redis").start()
    ray.init(num_cpus=3, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    cfg = start_service(
        redis_url=redis.url,
        data_dir=str(data_dir),
        model="tiny-llama",
        api_keys={KEY_A: "alpha", KEY_B: "beta"},
        admin_keys=[ADMIN_KEY],
        defaults=PolicyDefaults(**DEFAULTS),
        device_tier_mib=1,
        host_tier_mib=1,
        disk_tier_mib=64,
        max_prompt_tokens=2048,
        max_body_bytes=16 * 1024,
        max_new_tokens=1000,
        default_max_tokens=16,
        max_ongoing_requests=2,
        max_batch=2,
        max_queued_requests=4,
        overload_queue_len=2,
        request_timeout_s=REQUEST_TIMEOUT_S,
    )
    return cfg, redis


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the bounded version the tests run (minutes)")
    parser.add_argument("--out", default="bench/results", help="folder for reliability.json")
    args = parser.parse_args(argv)
    params = QUICK if args.quick else LONG
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="kvsnap-reliability-"))
    rec = Recorder()
    started = time.perf_counter()
    sessions = Sessions(params["sessions"], turns=params["turns_kill"] + QUESTIONS_BEYOND_KILL)
    print(f"reference answers for {len(sessions.ids)} sessions (in-process engine)...", flush=True)
    sessions.reference()
    print("starting Ray, Redis and the Serve app...", flush=True)
    cfg, redis = start(data_dir)
    client = Client(f"http://127.0.0.1:{cfg.http_port}", rec)
    grpc_addr = f"127.0.0.1:{cfg.grpc_port}"
    phases = [
        ("auth", lambda: phase_auth(client, grpc_addr, redis.url, rec)),
        ("setup", lambda: open_all(client, sessions, rec)),
        ("tenants", lambda: phase_tenants(client, grpc_addr, sessions, rec)),
        ("fuzz_http", lambda: phase_fuzz_http(client, out_dir, params["fuzz_examples"], rec)),
        ("fuzz_grpc", lambda: phase_fuzz_grpc(grpc_addr, params["grpc_cases"], cfg.max_body_bytes, rec)),
        ("disconnect", lambda: phase_disconnect(client, sessions, rec, n=2)),
        ("overload", lambda: phase_overload(client, sessions, cfg, rec)),
        ("corrupt", lambda: phase_corrupt(client, sessions, data_dir, redis.url, rec)),
        (
            "kill",
            lambda: phase_kill(
                client, sessions, params["kill_every_s"], params["kill_duration_s"], params["turns_kill"], rec
            ),
        ),
        ("redis", lambda: phase_redis(client, sessions, redis, params["redis_down_s"], rec)),
    ]
    try:
        for name, run in phases:
            t0 = time.perf_counter()
            print(f"[{time.perf_counter() - started:6.0f}s] {name}...", flush=True)
            run()
            rec.figures[name]["phase_s"] = round(time.perf_counter() - t0, 1)
        verify_all(client, sessions, "final", rec)
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        redis.stop()
    phase_logs(data_dir, rec)
    summary = rec.summary()
    lost = sum(v.get("sessions_lost", 0) for v in summary.values())
    by_policy = {
        policy: {
            "sessions": sum(1 for sid in sessions.ids if sessions.policy[sid] == policy),
            "lost": sum(v.get("by_policy", {}).get(policy, {}).get("lost", 0) for v in summary.values()),
            # checked answers, each equal to the uninterrupted twin's, by where their KV came from
            "answers_by_source": dict(
                sum(
                    (Counter(v.get("sources_by_policy", {}).get(policy, {})) for v in summary.values()),
                    Counter(),
                )
            ),
            "wrong_answers": sum(1 for f in rec.failures if f"[{policy}]" in f),
        }
        for policy in sorted(set(sessions.policy.values()))
    }
    report = {
        "mode": "quick" if args.quick else "long",
        "params": params,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "sessions": len(sessions.ids),
        "sessions_lost": lost,
        "by_policy": by_policy,
        "requests": sum(v.get("requests", 0) for v in summary.values()),
        "faults": {
            "replicas_killed": summary.get("kill", {}).get("replicas_killed", 0),
            "redis_crashes": 1,
            "redis_wipes": 1,
            "blobs_corrupted": summary.get("corrupt", {}).get("files_corrupted", 0),
            "streams_cut": summary.get("disconnect", {}).get("streams_cut", 0),
        },
        "phases": summary,
        "failures": rec.failures,
    }
    (out_dir / "reliability.json").write_text(json.dumps(report, indent=1))
    print(format_table(report))
    print(f"wrote {out_dir / 'reliability.json'}")
    return 1 if rec.failures else 0


def format_table(report: dict) -> str:
    lines = [
        f"\nreliability ({report['mode']}): {report['requests']} requests, {report['sessions']} verified sessions, "
        f"{report['sessions_lost']} lost, {len(report['failures'])} failed checks, {report['elapsed_s']:.0f}s",
        f"faults: {report['faults']}",
        f"by policy: {report['by_policy']}",
        f"{'phase':18}{'requests':>9}{'max s':>8}  statuses / figures",
    ]
    for phase, s in report["phases"].items():
        extra = {k: v for k, v in s.items() if k not in ("requests", "max_latency_s", "by_status")}
        lines.append(
            f"{phase:18}{s.get('requests', 0):>9}{s.get('max_latency_s', 0):>8}  {s.get('by_status', {})} {extra}"
        )
    for failure in report["failures"]:
        lines.append(f"FAILED: {failure}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
