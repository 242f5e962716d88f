"""Building the Ray Serve application: an ingress in front of N worker replicas whose
requests go through the cache-affinity router."""

from __future__ import annotations

import time

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvsnap.actors.replica import WorkerReplica

from .config import ServiceConfig
from .ingress import Ingress
from .routing import AffinityRouter

APP_NAME = "kvsnap"
# Ray gives the head node this resource (Serve pins its controller with it): the ingress asks a
# sliver of it, so it runs on the head (on demand on a cluster), never on a spot worker node.
HEAD_NODE = {"node:__internal_head__": 0.001}


def build_app(cfg: ServiceConfig, redis_url: str):
    gpus = cfg.gpus_per_replica if cfg.gpus_per_replica >= 0 else (1 if torch.cuda.is_available() else 0)
    router = RequestRouterConfig(
        request_router_class=AffinityRouter,
        request_router_kwargs={
            "redis_url": redis_url,
            "overload_queue_len": cfg.overload_queue_len,
            "affinity": cfg.routing == "affinity",
        },
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    )
    worker = serve.deployment(
        WorkerReplica,
        name="Worker",
        num_replicas=cfg.replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, "num_gpus": gpus, "resources": dict(cfg.worker_resources)},
        request_router_config=router,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
    )
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        num_replicas=1,
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE},
    )
    config = cfg.model_dump()
    return ingress.bind(worker.bind(config, redis_url), config, redis_url)


def app_builder(args: dict):
    """Entry point for Serve config files: ``import_path: kvsnap.service.app:app_builder``.

    ``args`` are ServiceConfig fields; ``redis_url`` (or ``KVSNAP_REDIS_URL``) is required
    here, since a cluster's replicas must share one Redis.
    """
    cfg = ServiceConfig.from_env(**(args or {}))
    if not cfg.redis_url:
        raise ValueError("a Serve config deployment needs redis_url (or KVSNAP_REDIS_URL)")
    if not cfg.api_keys:
        raise ValueError("a Serve config deployment needs api_keys (or KVSNAP_API_KEYS)")
    return build_app(cfg, cfg.redis_url)


def wait_for_workers(count: int, timeout_s: float = 120) -> bool:
    """True once Serve runs ``count`` healthy worker replicas of the app (after a start, a
    replica kill or a drain); False if they are not back within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications[APP_NAME].deployments["Worker"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == count:
            return True
        time.sleep(0.5)
    return False
