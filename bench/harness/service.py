"""What every service benchmark shares: a local service per phase, each phase in its own process.

A phase is a function that gets a running service (its :class:`ServiceConfig`) and returns a
JSON-able dict. :func:`run_phases` starts ``python <script> --phase NAME ...`` for each, so
every phase has its own local Ray, embedded Redis and Serve app and nothing carries over
(caches, compiled kernels, Redis keys) from one to the next; the child prints one
``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from kvsnap.service.config import ray_environment

# The Ray Serve data path `kvsnap serve` uses, set before anything imports Ray (Serve reads it at
# import, in this process too); a phase process started with these variables set keeps its own.
ray_environment()

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def start_service(**overrides):
    """A local Serve app with the bench API key; returns its config once /health answers."""
    from ray import serve

    from kvsnap.ports import free_port
    from kvsnap.service.app import APP_NAME, build_app
    from kvsnap.service.config import PolicyDefaults, ServiceConfig

    fields = dict(
        replicas=2,
        cpus_per_replica=1,
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys={KEY: "bench"},
        max_queued_requests=64,
        max_new_tokens=64,
        default_max_tokens=16,
        request_timeout_s=900,
        defaults=PolicyDefaults(policy="snapkv", budget=512, window=32, kernel=7, spans=False),  # as its results ran
    )
    redis_url, data_dir = overrides.pop("redis_url"), overrides.pop("data_dir")
    cfg = ServiceConfig(**(fields | overrides), data_dir=data_dir)
    serve.start(http_options={"host": "127.0.0.1", "port": cfg.http_port})
    serve.run(build_app(cfg, redis_url), name=APP_NAME, route_prefix="/")
    cfg.redis_url = redis_url  # for a phase that reads the directory (the app got it as built)
    deadline = time.time() + 180  # the HTTP proxy may still be (re)starting
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{cfg.http_port}/health", timeout=2).ok:
                return cfg
        except requests.ConnectionError:
            if time.time() > deadline:
                raise
        time.sleep(0.5)


def in_own_ray(phase, *args, num_cpus: int = 2, **service):
    """Run ``phase(cfg, *args)`` against a fresh local service (Ray, embedded Redis, Serve app)."""
    import ray
    from ray import serve

    from kvsnap.store.redis_server import EmbeddedRedis

    data = tempfile.mkdtemp(prefix="kvsnap-bench-")
    redis = EmbeddedRedis(Path(data) / "redis").start()
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        cfg = start_service(redis_url=redis.url, data_dir=data, **service)
        return phase(cfg, *args)
    finally:
        serve.shutdown()
        ray.shutdown()
        redis.stop()


def run_phase_process(
    script: str | Path,
    phase: str,
    argv: list[str],
    timeout_s: float = 3600,
    env: dict[str, str] | None = None,
    python: str | Path = sys.executable,
    cwd: Path | None = None,
) -> dict:
    """``python script --phase phase *argv`` in a child process (with ``env`` added to this
    process's environment; ``python`` and ``cwd``: another tree's); its RESULT line, parsed."""
    cmd = [str(python), str(script), "--phase", phase, *argv]
    child_env = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout_s, env=child_env, cwd=cwd)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"phase {phase} failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return json.loads(line[len("RESULT ") :])


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)
