"""Cluster deployment's configs (cluster/aws.yaml, cluster/serve.yaml): they pass Ray's and
Serve's own validation, every node starts Ray with the local data path, the tier budgets fit
every node type that hosts a worker replica, and the Serve config runs like `kvsnap serve`."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from kvsnap.engine.defaults import default_settings
from kvsnap.service.config import ServiceConfig

from ..service.helpers import DOC

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def test_cluster_config_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs before touching AWS
    spot_types = [
        t
        for t in config["available_node_types"].values()
        if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    ]
    assert len({t["node_config"]["InstanceType"] for t in spot_types}) >= 2
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert "InstanceMarketOptions" not in head  # the head (Redis, controller) is on demand


def test_every_cluster_node_starts_ray_with_the_local_data_path():
    from kvsnap.service.config import FAST_PATH_ENV

    config = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    switches = [k for k in FAST_PATH_ENV if "DRAINING" not in k]  # clusters keep Serve's drain period
    assert switches
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = next(c for c in commands if "ray start" in c)
        exported = start[: start.index("ray start")]
        assert all(f"{k}={FAST_PATH_ENV[k]}" in exported for k in switches), start


def test_cluster_config_rejects_a_broken_one():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    config["available_node_types"]["head"]["unknown_field"] = 1
    with pytest.raises(Exception, match="unknown_field|Additional properties"):
        validate_config(prepare_config(config))


def test_serve_config_passes_serves_schema_and_kvsnaps_config():
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((CLUSTER / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "kvsnap.service.app:app_builder"
    cfg = ServiceConfig(**app.args)  # every arg is a known, valid field
    # the replica count is a deployment override (changing it keeps running replicas), not an arg
    assert "replicas" not in app.args and [(d.name, d.num_replicas) for d in app.deployments] == [("Worker", 2)]
    assert cfg.session_defaults() == default_settings(cfg.model) and cfg.gpus_per_replica == 1  # measured defaults
    # replicas ask the custom resource only the cluster's GPU worker nodes offer
    aws = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    offered = {
        name for name, t in aws["available_node_types"].items() if set(cfg.worker_resources) <= set(t["resources"])
    }
    assert cfg.worker_resources and offered == {
        n for n, t in aws["available_node_types"].items() if t["resources"].get("GPU")
    }


@dataclass(frozen=True)
class Instance:
    vcpus: int
    ram_gib: float
    gpus: int = 0
    gpu: str = ""
    gpu_mib: int = 0  # per GPU, as the driver reports it (nvidia-smi "Total"), less than the card's nominal 24 GiB


# Every EC2 type cluster/aws.yaml may name; a type missing here fails the sizing test.
INSTANCES = {
    "m6i.2xlarge": Instance(vcpus=8, ram_gib=32),
    "g5.xlarge": Instance(vcpus=4, ram_gib=16, gpus=1, gpu="A10G 24 GiB", gpu_mib=23028),
    "g5.2xlarge": Instance(vcpus=8, ram_gib=32, gpus=1, gpu="A10G 24 GiB", gpu_mib=23028),
    "g6.xlarge": Instance(vcpus=4, ram_gib=16, gpus=1, gpu="L4 24 GiB", gpu_mib=23034),
    "g6.2xlarge": Instance(vcpus=8, ram_gib=32, gpus=1, gpu="L4 24 GiB", gpu_mib=23034),
}


@dataclass(frozen=True)
class Footprint:
    host_gib: float  # a replica process besides its tiers: Python, torch and CUDA libraries, weights on load
    gpu_gib: float  # GPU memory besides the device tier: weights, CUDA context, one prefill chunk's work


# What a worker replica of each model takes outside its tiers (serve.yaml's model must be here).
# gemma3-270m: 0.5 GiB of bf16 weights on the GPU (1.1 GiB fp32 while they load through host
# memory), about 2.5 GiB resident for Python, torch and the CUDA libraries, and on the GPU a CUDA
# context plus one 1,024-token prefill chunk's activations and logits (262k vocabulary).
MODELS = {"gemma3-270m": Footprint(host_gib=4.0, gpu_gib=4.0)}


# Per node, besides the replicas: the OS (a 16 GiB instance shows about 15.4 GiB to Linux; sshd,
# the spot watcher) and Ray's own processes (raylet, dashboard and runtime-env agents, Serve's
# proxy and HAProxy; on the head also the Ingress replica, which build_app pins there).
OS_RESERVE_GIB = 1.5


RAY_PROCESSES_GIB = 3.0


# Root volume, besides a disk tier: the AMI's system, the kvsnap venv with CUDA torch, the model
# cache, Ray's logs and spilled objects.
DISK_RESERVE_GIB = 100


def object_store_gib(aws: dict, node_type: str, ram_gib: float) -> float:
    """The object store the node's `ray start` asks (bytes), or Ray's default of 30 % of RAM."""
    commands = aws["head_start_ray_commands" if node_type == aws["head_node_type"] else "worker_start_ray_commands"]
    found = re.search(r"--object-store-memory[= ](\d+)", " ".join(commands))
    return int(found.group(1)) / 2**30 if found else 0.3 * ram_gib


def sizing_problems(aws: dict, serve: dict) -> list[str]:
    """Every way the Serve config's tier budgets overflow a node type of the cluster config."""
    cfg = ServiceConfig(**serve["applications"][0]["args"])
    problems = []
    model = MODELS.get(cfg.model)
    if model is None:
        return [f"no memory footprint for model {cfg.model!r}: add it to MODELS"]
    for name, node in aws["available_node_types"].items():
        kind = node["node_config"]["InstanceType"]
        instance = INSTANCES.get(kind)
        if instance is None:
            problems.append(f"{name}: instance type {kind} is not in the INSTANCES table")
            continue
        cpus, gpus = node["resources"].get("CPU", 0), node["resources"].get("GPU", 0)
        if cpus > instance.vcpus or gpus > instance.gpus:
            problems.append(f"{name}: declares {cpus} CPU / {gpus} GPU, {kind} has {instance.vcpus} / {instance.gpus}")
        # worker replicas Ray can place on one node of this type
        per_node = math.floor(cpus / cfg.cpus_per_replica)
        if cfg.gpus_per_replica > 0:
            per_node = min(per_node, math.floor(gpus / cfg.gpus_per_replica))
        for resource, amount in cfg.worker_resources.items():  # custom resources pin replicas to node types
            per_node = min(per_node, math.floor(node["resources"].get(resource, 0) / amount))
        if per_node == 0:
            continue  # hosts no worker replica (the head)
        on_gpu = cfg.gpus_per_replica > 0
        per_replica = cfg.host_tier_mib / 1024 + model.host_gib + (0 if on_gpu else cfg.device_tier_mib / 1024)
        node_reserve = OS_RESERVE_GIB + RAY_PROCESSES_GIB + object_store_gib(aws, name, instance.ram_gib)
        if per_node * per_replica + node_reserve > instance.ram_gib:
            problems.append(
                f"{name} ({kind}, {instance.ram_gib:g} GiB RAM): {per_node} replica(s) x {per_replica:g} GiB "
                f"(host tier + process) + {node_reserve:g} GiB node reserve does not fit"
            )
        if on_gpu:
            per_gpu = max(1, math.floor(1 / cfg.gpus_per_replica))  # a replica's engine uses one GPU
            need_mib = per_gpu * (cfg.device_tier_mib + model.gpu_gib * 1024)
            if need_mib > instance.gpu_mib:
                problems.append(
                    f"{name} ({kind}, {instance.gpu}): {per_gpu} replica(s) x (device tier {cfg.device_tier_mib} MiB "
                    f"+ model {model.gpu_gib:g} GiB) > {instance.gpu_mib} MiB"
                )
        volume = sum(m.get("Ebs", {}).get("VolumeSize", 0) for m in node["node_config"].get("BlockDeviceMappings", []))
        if cfg.disk_tier_mib and per_node * cfg.disk_tier_mib / 1024 > volume - DISK_RESERVE_GIB:
            problems.append(f"{name}: {per_node} x disk tier {cfg.disk_tier_mib} MiB > {volume} GiB volume - reserve")
    return problems


def test_tier_budgets_fit_every_node_type_that_hosts_a_replica():
    aws = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    serve = yaml.safe_load((CLUSTER / "serve.yaml").read_text())
    assert sizing_problems(aws, serve) == []
    hosts = [
        n["node_config"]["InstanceType"] for n in aws["available_node_types"].values() if n["resources"].get("GPU")
    ]
    assert {"g5.xlarge", "g6.xlarge"} <= set(hosts)  # the 16 GiB types the budgets are sized for


def test_sizing_check_catches_what_does_not_fit():
    aws = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    serve = yaml.safe_load((CLUSTER / "serve.yaml").read_text())
    args = serve["applications"][0]["args"]

    too_much_host = copy.deepcopy(serve)
    too_much_host["applications"][0]["args"] = args | {"host_tier_mib": 32768}  # 32 GiB pinned on a 16 GiB node
    problems = sizing_problems(aws, too_much_host)
    assert any("g5.xlarge" in p for p in problems) and any("g6.xlarge" in p for p in problems)

    too_much_device = copy.deepcopy(serve)
    too_much_device["applications"][0]["args"] = args | {"device_tier_mib": 22 * 1024}
    assert any("A10G" in p for p in sizing_problems(aws, too_much_device))

    unknown = copy.deepcopy(aws)
    unknown["available_node_types"]["gpu_g5_xlarge"]["node_config"]["InstanceType"] = "p4d.24xlarge"
    assert any("p4d.24xlarge is not in the INSTANCES table" in p for p in sizing_problems(unknown, serve))

    other_model = copy.deepcopy(serve)
    other_model["applications"][0]["args"] = args | {"model": "meta-llama/Llama-3.1-8B"}
    assert sizing_problems(aws, other_model) == [
        "no memory footprint for model 'meta-llama/Llama-3.1-8B': add it to MODELS"
    ]


def test_serve_config_runs_like_the_run_command(service, tmp_path):
    """The Serve config's application, built by its import path, serves the same API."""
    from ray import serve

    from kvsnap.ports import free_port
    from kvsnap.service.app import app_builder

    raw = yaml.safe_load((CLUSTER / "serve.yaml").read_text())
    args = raw["applications"][0]["args"] | {
        "model": "tiny-llama",
        "replicas": 1,
        "cpus_per_replica": 0.01,
        "gpus_per_replica": 0,
        "worker_resources": {},  # the local Ray has no kvsnap_worker nodes
        "grpc_port": free_port(),
        "redis_url": service.redis_url,
        "api_keys": {"cfg-key": "cfg"},
        "http_host": "127.0.0.1",
        "data_dir": str(tmp_path),
        "defaults": {"window": 8},
    }
    serve.run(app_builder(args), name="from-config", route_prefix="/from-config")
    try:
        base = f"{service.http}/from-config"
        headers = {"Authorization": "Bearer cfg-key"}
        made = requests.post(f"{base}/v1/sessions", headers=headers, json={"session_id": "c1", "document": DOC})
        assert made.status_code == 201, made.text
        answer = requests.post(
            f"{base}/v1/sessions/c1/turns", headers=headers, json={"message": "What is the pass key?", "max_tokens": 4}
        )
        assert answer.status_code == 200 and answer.json()["source"] == "device"
        assert (
            requests.get(f"{base}/v1/sessions/c1", headers={"Authorization": "Bearer key-alpha"}).status_code == 401
        )  # its own keys, not the other app's
    finally:
        serve.delete("from-config")
