"""Service benchmark (issue: Ray Serve service), measured side by side in one run.

1. Service overhead: the same small turn in-process, over HTTP and over gRPC
   (median of --reps; tiny-llama by default so model time does not drown the overhead).
2. Routing gain: multi-turn turns/s with --sessions concurrent sessions of --context
   tokens, cache-affinity routing vs round-robin (what a router without session
   affinity does: a turn that lands elsewhere is rebuilt from the token log).

Usage: python bench/service_bench.py [--model gemma3-270m] [--context 2048] [--sessions 16] [--turns 3]
Each phase (overhead, affinity, round_robin) runs in its own process with its own local
Ray, embedded Redis and Serve app.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import ray
import requests
import torch
from ray import serve

from kvsnap.actors import Engine, SamplingParams, load_model
from kvsnap.actors.redis_server import EmbeddedRedis, free_port
from kvsnap.service.app import APP_NAME, build_app
from kvsnap.service.config import PolicyDefaults, ServiceConfig
from kvsnap.service.grpc_stubs import pb2, pb2_grpc
from kvsnap.service.tasks import FILLER
from kvsnap.service.template import encode_messages

KEY = {"bench-key": "bench"}
HEADERS = {"Authorization": "Bearer bench-key"}


def start(model: str, routing: str, redis_url: str, data_dir: str) -> ServiceConfig:
    cfg = ServiceConfig(
        model=model,
        replicas=2,
        cpus_per_replica=1,
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=KEY,
        data_dir=data_dir,
        routing=routing,
        max_ongoing_requests=4,
        max_queued_requests=64,
        max_new_tokens=64,
        request_timeout_s=600,
        defaults=PolicyDefaults(budget=512, window=32),
    )
    serve.start(http_options={"host": "127.0.0.1", "port": cfg.http_port})
    serve.run(build_app(cfg, redis_url), name=APP_NAME, route_prefix="/")
    deadline = time.time() + 120  # the HTTP proxy may still be (re)starting
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{cfg.http_port}/health", timeout=2).ok:
                return cfg
        except requests.ConnectionError:
            if time.time() > deadline:
                raise
        time.sleep(0.5)


def stop() -> None:
    serve.delete(APP_NAME)


def overhead(model: str, reps: int, redis_url: str, data_dir: str) -> dict:
    cfg = start(model, "affinity", redis_url, data_dir)
    http = f"http://127.0.0.1:{cfg.http_port}"
    stub = pb2_grpc.KvsnapStub(grpc.insecure_channel(f"127.0.0.1:{cfg.grpc_port}"))
    md = [("authorization", "Bearer bench-key")]
    doc = FILLER * 8
    torch.set_num_threads(1)  # like one replica
    engine = Engine(load_model(model))
    local = engine.new_session("full")
    engine.prefill(local, encode_messages(engine.tokenizer, [{"role": "document", "content": doc}], True))
    requests.post(
        f"{http}/v1/sessions",
        headers=HEADERS,
        json={"session_id": "o-http", "document": doc, "settings": {"policy": "full"}},
    ).raise_for_status()
    stub.CreateSession(
        pb2.CreateSessionRequest(session_id="o-grpc", document=doc, settings=pb2.SessionSettings(policy="full")),
        metadata=md,
    )
    question = encode_messages(engine.tokenizer, [{"role": "user", "content": "Next?"}], False)
    times = {"in_process": [], "http": [], "grpc": []}
    for _ in range(reps):  # interleaved
        t0 = time.perf_counter()
        engine.turn(local, question, SamplingParams(max_new_tokens=4))
        times["in_process"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        requests.post(
            f"{http}/v1/sessions/o-http/turns", headers=HEADERS, json={"message": "Next?", "max_tokens": 4}
        ).raise_for_status()
        times["http"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        list(
            stub.Turn(
                pb2.TurnRequest(session_id="o-grpc", message="Next?", sampling=pb2.Sampling(max_tokens=4)), metadata=md
            )
        )
        times["grpc"].append(time.perf_counter() - t0)
    stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_s": med,
        "http_added_ms": (med["http"] - med["in_process"]) * 1e3,
        "grpc_added_ms": (med["grpc"] - med["in_process"]) * 1e3,
    }


def load(model: str, routing: str, sessions: int, context: int, turns: int, redis_url: str, data_dir: str) -> dict:
    cfg = start(model, routing, redis_url, data_dir)
    http = f"http://127.0.0.1:{cfg.http_port}"
    tok_per_filler = 20  # about; the exact count is reported by the service
    doc = FILLER * max(1, context // tok_per_filler)

    def user(i: int) -> dict:
        sid = f"{routing}-{i}"
        r = requests.post(f"{http}/v1/sessions", headers=HEADERS, json={"session_id": sid, "document": doc})
        r.raise_for_status()
        return r.json()

    with ThreadPoolExecutor(sessions) as pool:
        states = list(pool.map(user, range(sessions)))

    def follow_ups(i: int) -> list[dict]:
        out = []
        for k in range(turns):
            t0 = time.perf_counter()
            r = requests.post(
                f"{http}/v1/sessions/{routing}-{i}/turns",
                headers=HEADERS,
                json={"message": f"Question {k}: what comes next?", "max_tokens": 8},
            )
            r.raise_for_status()
            out.append({"latency_s": time.perf_counter() - t0, "source": r.json()["source"]})
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        results = [x for user_turns in pool.map(follow_ups, range(sessions)) for x in user_turns]
    elapsed = time.perf_counter() - t0
    stop()
    hits = sum(r["source"] in ("device", "host", "disk") for r in results)
    return {
        "turns": len(results),
        "elapsed_s": elapsed,
        "turns_per_s": len(results) / elapsed,
        "p50_s": statistics.median(r["latency_s"] for r in results),
        "p99_s": sorted(r["latency_s"] for r in results)[max(0, int(0.99 * len(results)) - 1)],
        "affinity_hits": hits,
        "context_tokens": states[0]["logical_len"],
    }


def run_phase(args) -> dict:
    """One phase in this process: its own local Ray, embedded Redis and Serve app."""
    data = tempfile.mkdtemp(prefix="kvsnap-bench-")
    redis = EmbeddedRedis(Path(data) / "redis").start()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        if args.phase == "overhead":
            return overhead(args.overhead_model, args.reps, redis.url, data)
        return load(args.model, args.phase, args.sessions, args.context, args.turns, redis.url, data)
    finally:
        serve.shutdown()
        ray.shutdown()
        redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--overhead-model", default="tiny-llama")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--phase",
        choices=["overhead", "affinity", "round_robin"],
        default=None,
        help="run one phase and print its JSON (the default runs all three, one process each)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "service_bench.json"))
    args = ap.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(run_phase(args)), flush=True)
        return

    result = {"args": vars(args)}
    for phase in ("overhead", "affinity", "round_robin"):  # a fresh Ray per phase: nothing carries over
        cmd = [sys.executable, __file__, "--phase", phase] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("phase", "out")
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"phase {phase} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        result[phase] = json.loads(line[len("RESULT ") :])
        print(phase, json.dumps(result[phase]), flush=True)
    gain = result["affinity"]["turns_per_s"] / result["round_robin"]["turns_per_s"]
    result["routing_gain"] = gain
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    o = result["overhead"]
    print(
        f"\nservice overhead ({args.overhead_model}, 4-token turn, median of {args.reps}): "
        f"HTTP +{o['http_added_ms']:.1f} ms, gRPC +{o['grpc_added_ms']:.1f} ms over in-process "
        f"{o['median_s']['in_process'] * 1e3:.1f} ms"
    )
    a, r = result["affinity"], result["round_robin"]
    print(
        f"{args.sessions} sessions x {args.turns} follow-ups at {a['context_tokens']} tokens ({args.model}): "
        f"affinity {a['turns_per_s']:.2f} turns/s (p99 {a['p99_s']:.1f}s, hits {a['affinity_hits']}/{a['turns']}) "
        f"vs round-robin {r['turns_per_s']:.2f} turns/s (p99 {r['p99_s']:.1f}s, hits {r['affinity_hits']}) "
        f"-> {gain:.1f}x"
    )


if __name__ == "__main__":
    main()
