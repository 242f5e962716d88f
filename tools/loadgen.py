"""The multi-turn load generator behind ``kvsnap load``: simulated RAG users against a running service.

Each user opens a session with its own synthetic document of about ``context`` tokens,
then asks ``turns`` follow-ups one after another, streaming each answer (SSE over HTTP,
server streaming over gRPC) so that time to first token is measured at the client.
Users arrive all at once (``closed``: a closed loop of N users) or as a Poisson process of
``rate`` users per second (``poisson``); with ``open_first`` every session is opened before
any follow-up starts, so that turns/s and turn latencies measure follow-ups alone. The
report: TTFT, time per output token and end-to-end latency of follow-up turns (p50 / p90 /
p99), the document-open latency, turns/s, errors by status, and where each turn's KV came
from (the replica's own tier = an affinity hit; ``rebuilt`` = re-prefilled from the token log).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from kvsnap.errors import InvalidArgument

from .tasks import FILLER, INTRO

HELD = ("device", "host", "disk")  # a turn served from the replica's own tier: an affinity hit


@dataclass(slots=True)
class LoadSpec:
    users: int = 8
    context: int = 2048  # document tokens per session (about; the service reports the exact count)
    turns: int = 3  # follow-ups per user, after the document
    max_tokens: int = 16
    protocol: str = "http"  # http | grpc
    arrival: str = "closed"  # closed | poisson
    rate: float = 1.0  # users per second (poisson)
    settings: dict = field(default_factory=dict)  # session settings (policy, budget, ...); {} = service defaults
    timeout_s: float = 600.0
    seed: int = 0
    open_first: bool = False  # every user opens its session, then all start their follow-ups together

    def __post_init__(self) -> None:
        if self.users < 1 or self.turns < 0 or self.context < 16 or self.max_tokens < 1:
            raise InvalidArgument("users >= 1, turns >= 0, context >= 16 and max_tokens >= 1 are needed")
        if self.protocol not in ("http", "grpc") or self.arrival not in ("closed", "poisson"):
            raise InvalidArgument("protocol is http | grpc and arrival is closed | poisson")
        if self.arrival == "poisson" and self.rate <= 0:
            raise InvalidArgument("poisson arrivals need rate > 0")


@dataclass(slots=True)
class Sample:
    """One request as the client saw it."""

    kind: str  # open | turn
    status: str  # "200" / "201" / "OK" on success, else the HTTP status or gRPC code name
    e2e_s: float
    ttft_s: float = 0.0
    tokens: int = 0
    source: str = ""
    logical_len: int = 0
    gaps: list[float] = field(default_factory=list)  # gRPC: time between streamed chunks (inter-token latency)

    @property
    def ok(self) -> bool:
        return self.status in ("200", "201", "OK")


def document(tokenizer, tokens: int, user: int) -> str:
    """About ``tokens`` tokens of filler, with a line that makes each user's document its own."""
    head = f"Document of user {user}. " + INTRO
    per_filler = len(tokenizer.encode(FILLER * 10, add_special_tokens=False)) / 10
    overhead = len(tokenizer.encode(head, add_special_tokens=True))
    return head + FILLER * max(1, int((tokens - overhead) / per_filler))


# -- clients: one session-API call each, timed at the client -----------------------------------


class HttpClient:
    def __init__(self, url: str, api_key: str, timeout_s: float):
        import requests

        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.local = threading.local()  # one keep-alive connection pool per user thread
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self._requests = requests

    @property
    def http(self):
        if not hasattr(self.local, "s"):
            self.local.s = self._requests.Session()
            self.local.s.headers.update(self.headers)
        return self.local.s

    def open(self, sid: str, text: str, settings: dict) -> Sample:
        t0 = time.perf_counter()
        r = self.http.post(
            f"{self.url}/v1/sessions",
            json={"session_id": sid, "document": text, "settings": settings},
            timeout=self.timeout_s,
        )
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        return Sample("open", str(r.status_code), time.perf_counter() - t0, logical_len=body.get("logical_len", 0))

    def turn(self, sid: str, message: str, max_tokens: int) -> Sample:
        t0 = time.perf_counter()
        ttft, tokens, final = 0.0, 0, {}
        with self.http.post(
            f"{self.url}/v1/sessions/{sid}/turns",
            json={"message": message, "max_tokens": max_tokens, "temperature": 0, "stream": True},
            stream=True,
            timeout=self.timeout_s,
        ) as r:
            if r.status_code != 200:
                return Sample("turn", str(r.status_code), time.perf_counter() - t0)
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # failed after the stream began
                    return Sample("turn", str(event["error"].get("code", "stream-error")), time.perf_counter() - t0)
                if "text" in event and "state" not in event:
                    tokens += 1
                    ttft = ttft or time.perf_counter() - t0
                else:
                    final = event
        e2e = time.perf_counter() - t0
        return Sample(
            "turn",
            "200",
            e2e,
            ttft or e2e,  # nothing generated (EOS first): the answer came whole
            final.get("completion_tokens", tokens),
            final.get("source", ""),
            (final.get("state") or {}).get("logical_len", 0),
        )


class GrpcClient:
    def __init__(self, target: str, api_key: str, timeout_s: float):
        import grpc

        from kvsnap.service.grpc_stubs import pb2, pb2_grpc

        self.grpc, self.pb2, self.timeout_s = grpc, pb2, timeout_s
        self.stub = pb2_grpc.KvsnapStub(grpc.insecure_channel(target))
        self.md = [("authorization", f"Bearer {api_key}")]

    def open(self, sid: str, text: str, settings: dict) -> Sample:
        t0 = time.perf_counter()
        try:
            state = self.stub.CreateSession(
                self.pb2.CreateSessionRequest(
                    session_id=sid, document=text, settings=self.pb2.SessionSettings(**settings)
                ),
                metadata=self.md,
                timeout=self.timeout_s,
            )
        except self.grpc.RpcError as exc:
            return Sample("open", exc.code().name, time.perf_counter() - t0)
        return Sample("open", "OK", time.perf_counter() - t0, logical_len=state.logical_len)

    def turn(self, sid: str, message: str, max_tokens: int, fixed_length: bool = False) -> Sample:
        """``fixed_length``: exactly ``max_tokens`` tokens (no end-of-sequence stop, a raw turn
        with no stop string), as throughput benchmarks need."""
        t0 = time.perf_counter()
        ttft, tokens, last, previous, gaps = 0.0, 0, None, 0.0, []
        sampling = self.pb2.Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=fixed_length)
        request = self.pb2.TurnRequest(session_id=sid, message=message, sampling=sampling, raw=fixed_length)
        try:
            for chunk in self.stub.Turn(request, metadata=self.md, timeout=self.timeout_s):
                if chunk.done:
                    last = chunk
                elif chunk.text or chunk.token_ids:
                    now = time.perf_counter()
                    if previous:  # one gap per chunk, whatever it carries (a burst is not averaged away)
                        gaps.append(now - previous)
                    previous, tokens = now, tokens + max(1, len(chunk.token_ids))
                    ttft = ttft or now - t0
        except self.grpc.RpcError as exc:
            return Sample("turn", exc.code().name, time.perf_counter() - t0)
        if last is None:
            return Sample("turn", "INCOMPLETE", time.perf_counter() - t0)
        e2e = time.perf_counter() - t0
        return Sample("turn", "OK", e2e, ttft or e2e, last.completion_tokens, last.source, last.state.logical_len, gaps)


# -- the run ---------------------------------------------------------------------------------------


def run(client, tokenizer, spec: LoadSpec, progress_s: float = 2.0, log=sys.stderr) -> dict:
    """Run the load and return the report (see :func:`report`)."""
    samples: list[Sample] = []
    lock = threading.Lock()
    started = time.perf_counter()
    tag = uuid.uuid4().hex[:8]
    rng = random.Random(spec.seed)
    arrivals = [0.0] * spec.users
    if spec.arrival == "poisson":
        for i in range(1, spec.users):
            arrivals[i] = arrivals[i - 1] + rng.expovariate(spec.rate)

    turns_started = [started]
    barrier = threading.Barrier(spec.users, action=lambda: turns_started.__setitem__(0, time.perf_counter()))

    def user(i: int) -> None:
        time.sleep(max(0.0, started + arrivals[i] - time.perf_counter()))
        sid = f"load-{tag}-{i}"
        opened = client.open(sid, document(tokenizer, spec.context, i), spec.settings)
        with lock:
            samples.append(opened)
        if spec.open_first:
            barrier.wait()  # also after a failed open, so nobody waits for it
        for k in range(spec.turns if opened.ok else 0):
            s = client.turn(sid, f"Question {k + 1}: what is this document about?", spec.max_tokens)
            with lock:
                samples.append(s)

    done = threading.Event()

    def show() -> None:
        while not done.wait(progress_s):
            with lock:
                snap = list(samples)
            turns = [s for s in snap if s.kind == "turn" and s.ok]
            errors = sum(not s.ok for s in snap)
            p50 = f"{statistics.median(s.ttft_s for s in turns):.2f}s" if turns else "-"
            print(
                f"[{time.perf_counter() - started:6.1f}s] opened {sum(s.kind == 'open' for s in snap)}/{spec.users} "
                f"turns {len(turns)}/{spec.users * spec.turns} errors {errors} TTFT p50 {p50}",
                file=log,
                flush=True,
            )

    watcher = threading.Thread(target=show, daemon=True)
    if progress_s > 0:
        watcher.start()
    try:
        with ThreadPoolExecutor(spec.users) as pool:
            list(pool.map(user, range(spec.users)))
    finally:
        done.set()
    ended = time.perf_counter()
    return report(samples, ended - started, spec, turns_s=ended - turns_started[0])


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return {"p50": statistics.median(ordered), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def report(samples: list[Sample], elapsed_s: float, spec: LoadSpec, turns_s: float | None = None) -> dict:
    """``turns_s``: how long the follow-ups ran (with ``open_first``, from when every session was open)."""
    turns = [s for s in samples if s.kind == "turn" and s.ok]
    opens = [s for s in samples if s.kind == "open" and s.ok]
    tpot = [(s.e2e_s - s.ttft_s) / (s.tokens - 1) for s in turns if s.tokens > 1]
    sources = Counter(s.source for s in turns)
    return {
        "spec": asdict(spec),
        "elapsed_s": elapsed_s,
        "sessions_opened": len(opens),
        "turns_ok": len(turns),
        "turns_elapsed_s": turns_s or elapsed_s,
        "turns_per_s": len(turns) / (turns_s or elapsed_s) if elapsed_s else 0.0,
        "ttft_s": percentiles([s.ttft_s for s in turns]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([g for s in turns for g in s.gaps]),  # per token (gRPC only)
        "decode_tokens_per_s": sum(s.tokens for s in turns) / (turns_s or elapsed_s) if elapsed_s else 0.0,
        "e2e_s": percentiles([s.e2e_s for s in turns]),
        "open_s": percentiles([s.e2e_s for s in opens]),
        "errors": dict(Counter(s.status for s in samples if not s.ok)),
        "sources": dict(sources),
        "affinity_hits": sum(sources[k] for k in HELD),
        "context_tokens": statistics.median(s.logical_len for s in opens) if opens else 0,
    }


def format_report(r: dict) -> str:
    def ms(p: dict) -> str:
        return " ".join(f"{k} {v * 1e3:8.1f}" if v is not None else f"{k}        -" for k, v in p.items())

    s = r["spec"]
    return "\n".join(
        [
            f"{s['users']} users x {s['turns']} follow-ups, {r['context_tokens']:.0f}-token documents, "
            f"{s['protocol']}, {s['arrival']} arrivals, {r['elapsed_s']:.1f}s",
            f"turns ok {r['turns_ok']}  turns/s {r['turns_per_s']:.2f} (over {r['turns_elapsed_s']:.1f}s)  "
            f"sessions opened {r['sessions_opened']}",
            f"TTFT ms       {ms(r['ttft_s'])}",
            f"per token ms  {ms(r['tpot_s'])}",
            f"turn e2e ms   {ms(r['e2e_s'])}",
            f"open ms       {ms(r['open_s'])}",
            f"errors by status {r['errors'] or '{}'}   KV source {r['sources']}",
        ]
    )
