"""The reliability suite's service plumbing: the service it starts (its own Redis, to crash and
wipe; local Ray; the app through the bench harness), the worker replicas Ray runs, and gRPC
calls by method descriptor (auth and fuzzing). The shared state of the phases is in
bench/reliability/common.py.
"""

from __future__ import annotations

from pathlib import Path

from reliability.common import ADMIN_KEY, DEFAULTS, KEY_A, KEY_B, REQUEST_TIMEOUT_S  # sets the Ray environment

# -- gRPC calls by method descriptor (auth and fuzzing) ------------------------------------------


def grpc_callable(channel, service_name: str, method):
    path = f"/{service_name}/{method.name}"
    if method.server_streaming:
        stream = channel.unary_stream(path)
        return lambda payload, **kw: list(stream(payload, **kw))
    return channel.unary_unary(path)


def grpc_code(call) -> str:
    import grpc

    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


# -- service plumbing ----------------------------------------------------------------------------


def worker_actor_names() -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Worker#" in a["name"]}


def running_replicas() -> int:
    from ray import serve

    return serve.status().applications["kvsnap"].deployments["Worker"].replica_states.get("RUNNING", 0)


# the service the suite runs against (the harness's 2 worker replicas): tiny-llama; a device and a host
# tier of 1 MiB and a disk tier, so that sessions spread over all three; limits and queues small
# enough that hostile input and overload meet them
SERVICE = dict(model="tiny-llama", device_tier_mib=1, host_tier_mib=1, disk_tier_mib=64)
LIMITS = dict(max_prompt_tokens=2048, max_body_bytes=16 * 1024, max_new_tokens=1000, default_max_tokens=16)
QUEUES = dict(max_ongoing_requests=2, max_batch=2, max_queued_requests=4, overload_queue_len=2)


def start(data_dir: Path):
    """Redis (this script's own, to crash and wipe), local Ray and the app, via the bench harness."""
    import ray
    from harness.service import start_service

    from kvsnap.service.config import PolicyDefaults
    from kvsnap.store.redis_server import EmbeddedRedis

    redis = EmbeddedRedis(data_dir / "redis").start()
    ray.init(num_cpus=3, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    keys = dict(api_keys={KEY_A: "alpha", KEY_B: "beta"}, admin_keys=[ADMIN_KEY])
    service = SERVICE | LIMITS | QUEUES | keys | dict(request_timeout_s=REQUEST_TIMEOUT_S)
    cfg = start_service(redis_url=redis.url, data_dir=str(data_dir), defaults=PolicyDefaults(**DEFAULTS), **service)
    return cfg, redis
