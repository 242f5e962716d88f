"""What the reliability suite's phases share (bench/reliability/suite.py runs every phase; each
group also runs alone: bench/reliability/{auth,fuzzing,overload,faults}.py): the recorder of
every request, the verified sessions (some opened from registered documents) and their
uninterrupted twins. The service it starts and gRPC calls by descriptor are in
bench/reliability/local_service.py; the runner is bench/reliability/runner.py.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter, defaultdict

import requests

from kvsnap.service.config import ray_environment

ray_environment()  # the Ray Serve data path `kvsnap serve` uses, set before Ray is imported


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
        # two of every five sessions open from a registered document (POST /v1/documents), two
        # documents in turn, longer than a prefill chunk (1,024 tokens; the tiny models' tokens are
        # bytes) so that they start from the rows the document's holder shares
        self.shared = [
            f"Shared document {j}. The code word is {rng.choice(words)}-{rng.randint(100, 999)}. "
            + " ".join(rng.choice(words) for _ in range(200))  # ~1,300 tokens
            for j in range(2)
        ]
        self.document_of = {sid: (i // 5) % 2 for i, sid in enumerate(self.ids) if i % 5 >= 3}
        for sid, j in self.document_of.items():
            self.docs[sid] = self.shared[j]
        self.document_ids: dict[int, str] = {}  # filled by open_all
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


def register_documents(client: Client, sessions: Sessions, phase: str, rec: Recorder) -> None:
    """POST the shared documents; their ids are content addresses, the same on every call."""
    for j, text in enumerate(sessions.shared):
        r = client.request(phase, "post", "/v1/documents", json={"document": text})
        if r is None or r.status_code not in (200, 201):
            raise SystemExit(f"could not register shared document {j}: {None if r is None else r.text}")
        doc_id = sessions.document_ids.setdefault(j, r.json()["document_id"])
        rec.check(r.json()["document_id"] == doc_id, f"{phase}: document {j} came back as another id")
        rec.figures[phase].setdefault("shared_tokens", []).append(r.json()["shared_tokens"])


def open_all(client: Client, sessions: Sessions, rec: Recorder) -> None:
    """Open the verified sessions (some from a registered document), and the one the fuzzers may use."""
    register_documents(client, sessions, "setup", rec)
    rec.check(min(rec.figures["setup"]["shared_tokens"], default=0) > 0, "setup: a document holds no shared rows")
    docs = dict(sessions.docs) | {FUZZ_SESSION: "A document for the fuzzers."}
    for sid, doc in docs.items():
        body = {"session_id": sid, "document": doc}
        if sid in sessions.document_of:
            body = {"session_id": sid, "document_id": sessions.document_ids[sessions.document_of[sid]]}
        if sessions.policy.get(sid, "full") == "full":
            body["settings"] = {"policy": "full"}  # the others take the service's default (SnapKV)
        r = client.request("setup", "post", "/v1/sessions", json=body)
        if r is None or r.status_code != 201:
            raise SystemExit(f"could not open {sid}: {None if r is None else r.text}")
        if sid in sessions.policy:
            got = r.json()["policy"].split("(")[0]
            rec.check(got == sessions.policy[sid], f"setup: {sid} opened with {got}, want {sessions.policy[sid]}")
        if sid in sessions.document_of:
            cached = r.json().get("cached_tokens") or 0
            rec.check(cached > 0, f"setup: {sid} opened from a document but started from no shared rows")
            rec.figures["setup"]["document_sessions_cached_tokens"] = (
                rec.figures["setup"].get("document_sessions_cached_tokens", 0) + cached
            )


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
    on_documents = [sid for sid in sessions.ids if sid in sessions.document_of]
    rec.figures[phase]["on_documents"] = {
        "verified": sum(1 for sid in on_documents if sid not in lost),
        "lost": sum(1 for sid in on_documents if sid in lost),
    }
    return {"lost": lost, "sources": sources, "by_session": by_session}
