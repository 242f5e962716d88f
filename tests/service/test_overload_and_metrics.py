"""What an operator sees of the service: a flood answered 429 with Retry-After, then /health and
/metrics (the metrics once turns have run: the flood's)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from .helpers import FULL, create, turn


def test_overload_is_answered_429_with_retry_after(service):
    sids = [f"flood-{i}" for i in range(16)]
    for sid in sids:
        assert create(service, sid, FULL, document="A short document. " * 4).status_code == 201

    def hammer(sid):
        return turn(service, sid, "Write a lot.", max_tokens=1500)

    with ThreadPoolExecutor(len(sids)) as pool:
        responses = list(pool.map(hammer, sids))
    codes = sorted(r.status_code for r in responses)
    assert 429 in codes and 200 in codes, codes
    assert all(r.headers.get("Retry-After") for r in responses if r.status_code == 429)
    assert set(codes) <= {200, 429}


def _health_with_workers(service, timeout_s: float = 60) -> dict:
    """/health once a worker's load (published with its heartbeat) is in Redis."""
    deadline = time.monotonic() + timeout_s
    while (health := requests.get(f"{service.http}/health").json())["workers"] < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    return health


def test_metrics_and_health(service):
    health = _health_with_workers(service)  # no key needed: liveness, and what the workers compute in
    assert health["status"] == "ok" and health["model"] == "tiny-llama" and health["workers"] >= 1, health
    assert health["dtype"] == ["float32"] and health["device"] == ["cpu"], health  # the tiny presets: float32
    listed = requests.get(f"{service.http}/v1/models", headers=service.headers()).json()["data"]
    assert [(m["id"], m["dtype"]) for m in listed] == [("tiny-llama", ["float32"])]
    assert requests.get(f"{service.http}/metrics").status_code == 401
    text = requests.get(f"{service.http}/metrics", headers=service.headers()).text
    for name in (
        "kvsnap_ttft_seconds_bucket",
        "kvsnap_time_per_output_token_seconds_bucket",
        "kvsnap_prompt_tokens_total",
        "kvsnap_generated_tokens_total",
        "kvsnap_kv_bytes",
        "kvsnap_sessions",
        "kvsnap_affinity_hits_total",
        "kvsnap_session_moves_total",
        "kvsnap_session_rebuilds_total",
        "kvsnap_queue_wait_seconds_bucket",
        "# TYPE kvsnap_batch_size histogram",  # per worker, once it has run a step
        "# TYPE kvsnap_step_tokens histogram",
    ):
        assert name in text, name
    assert requests.get(f"{service.http}/openapi.json").json()["paths"]["/v1/sessions"]
