"""Service overhead benchmark (Ray Serve, HTTP and gRPC), measured side by side in one run.

The same small turn on a held session in-process, over HTTP and over gRPC (median of
--reps, interleaved; tiny-llama by default so model time does not drown the overhead).
The service runs in a child process's own local Ray, embedded Redis and Serve app, once
with the data path `kvsnap serve` uses (Ray Serve's HAProxy ingress and throughput-optimized
mode, ``FAST_PATH_ENV``) and once with Serve's standard Python proxy, for comparison.
Routing, resume and concurrency gains are measured by bench/service/suite.py.

Usage: python bench/service/overhead_bench.py [--overhead-model tiny-llama] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import grpc
import requests
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, options, write_json
from harness.service import HEADERS, KEY, emit, in_own_ray, run_phase_process

from kvsnap.engine import Engine, SamplingParams, load_model
from kvsnap.service.config import FAST_PATH_ENV
from kvsnap.service.grpc_stubs import pb2, pb2_grpc
from kvsnap.service.template import encode_messages
from kvsnap.tools.tasks import FILLER


def overhead(cfg, model: str, reps: int) -> dict:
    http = f"http://127.0.0.1:{cfg.http_port}"
    client = requests.Session()  # one keep-alive connection, as an SDK client keeps it
    channel = grpc.insecure_channel(f"127.0.0.1:{cfg.grpc_port}")
    stub, health = pb2_grpc.KvsnapStub(channel), health_pb2_grpc.HealthStub(channel)
    md = [("authorization", f"Bearer {KEY}")]
    doc = FILLER * 8
    torch.set_num_threads(1)  # like one replica
    engine = Engine(load_model(model))
    local = engine.new_session("full")
    engine.prefill(local, encode_messages(engine.tokenizer, [{"role": "document", "content": doc}], True))
    client.post(
        f"{http}/v1/sessions",
        headers=HEADERS,
        json={"session_id": "o-http", "document": doc, "settings": {"policy": "full"}},
    ).raise_for_status()
    stub.CreateSession(
        pb2.CreateSessionRequest(session_id="o-grpc", document=doc, settings=pb2.SessionSettings(policy="full")),
        metadata=md,
    )
    question = encode_messages(engine.tokenizer, [{"role": "user", "content": "Next?"}], False)
    calls = {  # interleaved, in this order, each timed alone
        "in_process": lambda: engine.turn(local, question, SamplingParams(max_new_tokens=4)),
        "http": lambda: client.post(
            f"{http}/v1/sessions/o-http/turns", headers=HEADERS, json={"message": "Next?", "max_tokens": 4}
        ).raise_for_status(),
        "grpc": lambda: list(
            stub.Turn(
                pb2.TurnRequest(session_id="o-grpc", message="Next?", sampling=pb2.Sampling(max_tokens=4)), metadata=md
            )
        ),
        # the front door alone: proxy + the ingress's HTTP app / gRPC server, no worker, no Redis
        "http_health": lambda: client.get(f"{http}/health").raise_for_status(),
        "grpc_health": lambda: health.Check(health_pb2.HealthCheckRequest(service="")),
    }
    times = {k: [] for k in calls}
    for _ in range(reps):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    channel.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_s": med,
        "http_added_ms": (med["http"] - med["in_process"]) * 1e3,
        "grpc_added_ms": (med["grpc"] - med["in_process"]) * 1e3,
    }


def main() -> None:
    ap = options(__doc__, overhead_model="tiny-llama", reps=20)
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--out", default=str(RESULTS / "service_bench.json"))
    args = ap.parse_args()
    if args.phase:
        emit(in_own_ray(overhead, args.overhead_model, args.reps, model=args.overhead_model))
        return
    argv = [f"--overhead-model={args.overhead_model}", f"--reps={args.reps}"]
    paths = {
        "fast": run_phase_process(__file__, "overhead", argv),
        "standard": run_phase_process(__file__, "overhead", argv, env=dict.fromkeys(FAST_PATH_ENV, "0")),
    }
    write_json(args.out, {"args": vars(args), "overhead": paths})
    print(f"service overhead ({args.overhead_model}, 4-token turn, median of {args.reps}; added to in-process):")
    for name, o in paths.items():
        label = "kvsnap serve's data path (HAProxy, throughput-optimized)" if name == "fast" else "standard Serve proxy"
        print(
            f"  {label}: HTTP +{o['http_added_ms']:.1f} ms, gRPC +{o['grpc_added_ms']:.1f} ms "
            f"(in-process {o['median_s']['in_process'] * 1e3:.1f} ms; the health check alone: "
            f"HTTP {o['median_s']['http_health'] * 1e3:.1f} ms, gRPC {o['median_s']['grpc_health'] * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main()
