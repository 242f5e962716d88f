"""kvsnap on a multi-node Ray cluster, all on this host (tests/local_cluster.py): a head node
(GCS, Serve controller, the HTTP proxy, the kvsnap ingress) and worker nodes that offer the
``kvsnap_worker`` resource the worker replicas ask (``worker_resources``, as cluster/aws.yaml and
cluster/serve.yaml do). The app is deployed from a Serve config (serve.yaml's shape, import path
``app_builder``), built on the cluster from the secrets and ``KVSNAP_REDIS_URL`` in the nodes'
environment: an external redis-server with a password that the service did not start.

Shown here: sessions spread over the worker nodes and every follow-up lands on its holder; a spot
preemption end to end (``kvsnap spot-watch`` on the node sees a notice from a fake metadata
server, drains the node through Ray's drain API, finds the replicas on its node in Ray's actor
table, moves their sessions through the admin route; then the node is killed whole); a worker
node lost without notice; Serve bringing the replica count back when a node joins; a scale-out
(a node joins, the config is deployed again with one more replica). Every answer
equals an uninterrupted in-process twin's (greedy). The figures are printed (``-s``) and
cluster/README.md quotes them.

One cluster for the module; the tests run in order and each but the last leaves the cluster with
two worker replicas on two live worker nodes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import requests

from kvsnap.engine import Engine, load_model
from kvsnap.policies import make_policy
from kvsnap.ports import free_port
from kvsnap.service.config import FALLBACK_PROXY_PORT_ENV, HAPROXY_PORT_ENV
from kvsnap.store.redis_server import EmbeddedRedis

from ..local_cluster import LocalRayCluster
from ..service.helpers import DOC, reference_answers
from .test_spot_watcher import FakeMetadata

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(300)]

API_KEY, TENANT = "key-mn", "mn"
ADMIN_KEY = "key-mn-admin"
WORKER = {"kvsnap_worker": 1}  # the custom resource of the worker nodes (cluster/aws.yaml)
SNAPKV = {"budget": 48, "window": 8, "kernel": 3, "pooling": "max", "spans": False}  # the deployment's defaults
QUESTIONS = ["What is the pass key?", "Where do foxes live?", "And when do they hunt?", "Say the key again."]
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 40  # the service's; a request that outlives it (plus slack) hung
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 15

# What `serve deploy cluster/serve.yaml` does, minus the dashboard this cluster has none of (the
# CLI posts the config to it, and it hands the config to the Serve controller): the controller
# builds the app from the config in a task on the cluster, whose nodes hold the secrets in their
# environment (as cluster/aws.yaml's nodes do). A config deploy, not serve.run: Serve then treats
# a changed `num_replicas` under `deployments:` as a light update that keeps running replicas.
DEPLOY = """
import json, os, time
import ray
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema
ray.init(address=os.environ["GCS"], logging_level="WARNING", log_to_driver=False)
config = ServeDeploySchema(**json.loads(os.environ["MN_CONFIG"]))
serve.start(proxy_location=config.proxy_location, http_options=config.http_options.model_dump())
_get_global_client().deploy_apps(config)
began = time.monotonic()
while time.monotonic() - began < 240:
    app = serve.status().applications.get("kvsnap")
    if app is not None and app.status == "RUNNING":
        break
    assert app is None or app.status != "DEPLOY_FAILED", app.message
    time.sleep(0.5)
else:
    raise TimeoutError(f"the app is not running after 240 s: {app}")
"""


def serve_config(args: dict, workers: int) -> dict:
    """The Serve config (cluster/serve.yaml's shape) for ``workers`` worker replicas."""
    return {
        "proxy_location": "HeadOnly",  # one HTTP proxy, on the head (all nodes share this host's ports)
        "http_options": {"host": "127.0.0.1", "port": args["http_port"]},
        "applications": [
            {
                "name": "kvsnap",
                "route_prefix": "/",
                "import_path": "kvsnap.service.app:app_builder",
                "args": args,
                "deployments": [{"name": "Worker", "num_replicas": workers}],
            }
        ],
    }


# Serve's own view: `count` worker replicas RUNNING, all on live nodes (Serve goes on counting a
# replica of a killed node as RUNNING until Ray declares the node dead)
WAIT_FOR_WORKERS = """
import os, time
import ray
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeInstanceDetails
ray.init(address=os.environ["GCS"], logging_level="WARNING", log_to_driver=False)
client = _get_global_client()
count, nodes = int(os.environ["MN_COUNT"]), set(os.environ["MN_NODES"].split(","))
began = time.monotonic()
while time.monotonic() - began < float(os.environ["MN_TIMEOUT"]):
    details = ServeInstanceDetails(**client.get_serve_details())
    replicas = details.applications["kvsnap"].deployments["Worker"].replicas
    seen = sorted((r.state, r.node_id in nodes) for r in replicas)
    if len(replicas) == count and all(r.state == "RUNNING" and r.node_id in nodes for r in replicas):
        print("MN_WAIT", True, time.monotonic() - began, flush=True)
        break
    time.sleep(0.25)
else:
    print("MN_WAIT", False, time.monotonic() - began, "last seen (state, on a live node):", seen, flush=True)
"""


@dataclass
class Session:
    sid: str
    policy: str  # "snapkv" (the deployment's default) or "full"
    doc: str
    want: list[str]  # the uninterrupted twin's answers
    answers: list[dict] = field(default_factory=list)  # the service's turn answers


@dataclass
class MultiNode:
    cluster: LocalRayCluster
    redis: EmbeddedRedis
    http: str
    args: dict
    twin: Engine
    nodes_seen: list[str] = field(default_factory=list)

    def open(self, sid: str, i: int) -> Session:
        """A session with a document of its own; even ``i``: SnapKV (the default), odd: full KV."""
        policy = "snapkv" if i % 2 == 0 else "full"
        doc = DOC.replace("48213", str(48213 + 7 * i))
        body = {"session_id": sid, "document": doc} | ({"settings": {"policy": "full"}} if policy == "full" else {})
        made = requests.post(f"{self.http}/v1/sessions", headers=auth(), json=body, timeout=CLIENT_TIMEOUT_S)
        assert made.status_code == 201, made.text
        spec = make_policy("snapkv", **SNAPKV) if policy == "snapkv" else make_policy("full")
        return Session(sid, policy, doc, reference_answers(self.twin, doc, QUESTIONS, MAX_TOKENS, spec))

    def deploy(self, workers: int) -> float:
        """(Re)deploy the app's config with ``workers`` worker replicas; seconds until RUNNING."""
        began = time.monotonic()
        self.cluster.run_driver(DEPLOY, {"MN_CONFIG": json.dumps(serve_config(self.args, workers))}, timeout_s=300)
        return time.monotonic() - began

    def wait_for_workers(self, count: int, timeout_s: float = 300) -> float:
        live = ",".join(n.node_id for n in self.cluster.nodes.values() if n.alive)
        env = {"MN_COUNT": str(count), "MN_NODES": live, "MN_TIMEOUT": str(timeout_s)}
        out = self.cluster.run_driver(WAIT_FOR_WORKERS, env, timeout_s=timeout_s + 60)
        # Ray may write to the driver's stdout too (a warning at exit): read the tagged line only
        tagged = [line.split() for line in out.splitlines() if line.startswith("MN_WAIT ")]
        assert tagged, f"the driver that waits for the workers printed no result:\n{out[-2000:]}"
        ok, took = tagged[-1][1:3]
        assert ok == "True", f"Serve did not run {count} worker replicas within {timeout_s} s: {out[-2000:]}"
        return float(took)

    def worker_nodes(self) -> dict[str, str]:
        """Worker replica id -> the node (name) it runs on, for the live nodes."""
        return {w: node for node, ids in self.cluster.replicas_by_node().items() for w in ids}


@dataclass
class Attempt:
    status: int  # HTTP status; 0: the client's own timeout (the request hung)
    began: float  # time.monotonic()
    took_s: float


def auth(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ask(mn: MultiNode, s: Session, give_up_s: float = 90) -> tuple[dict, float, list[Attempt]]:
    """The session's next question, retried on 503 / 429 as a client does: (answer, seconds from
    the first try to the answer, every attempt). Checks the answer against the twin's."""
    k = len(s.answers)
    began = time.monotonic()
    attempts: list[Attempt] = []
    while True:
        t0 = time.monotonic()
        try:
            r = requests.post(
                f"{mn.http}/v1/sessions/{s.sid}/turns",
                headers=auth(),
                json={"message": QUESTIONS[k], "max_tokens": MAX_TOKENS},
                timeout=CLIENT_TIMEOUT_S,
            )
            status = r.status_code
        except requests.Timeout:
            status = 0
        attempts.append(Attempt(status, t0, time.monotonic() - t0))
        if status == 200:
            break
        assert status in (429, 503), f"{s.sid} turn {k}: {status} {r.text if status else 'hung'}"
        assert time.monotonic() - began < give_up_s, f"{s.sid} turn {k}: still failing after {give_up_s} s"
        time.sleep(0.5)
    answer = r.json()
    assert answer["text"] == s.want[k], (s.sid, s.policy, k, answer)
    s.answers.append(answer)
    return answer, time.monotonic() - began, attempts


@pytest.fixture(scope="module")
def mn():
    root = Path(tempfile.mkdtemp(prefix="kvmn-", dir="/tmp"))  # short: Ray's socket paths live below it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # no token auth on this loopback cluster: `ray start` would turn it on when a token exists in
    # ~/.ray (a local ray.init makes one), and processes joining by address would not send it
    env["RAY_AUTH_MODE"] = "disabled"
    # HAProxy's own listeners and the fallback proxies': ports of this cluster's own (another local
    # Ray may hold the others; a fallback proxy's, shared with SO_REUSEPORT, would split requests)
    env |= {k: str(free_port()) for k in (*HAPROXY_PORT_ENV, *FALLBACK_PROXY_PORT_ENV)}
    password = secrets.token_urlsafe(16)
    store = EmbeddedRedis(root / "redis", password=password).start()  # "external": the service did not start it
    # the secrets live in the nodes' environment (cluster/aws.yaml: ~/kvsnap.env), never in the config
    env |= {
        "KVSNAP_REDIS_URL": store.url,  # redis://:<password>@127.0.0.1:<port>/0
        "KVSNAP_API_KEYS": f"{API_KEY}:{TENANT}",
        "KVSNAP_ADMIN_KEYS": ADMIN_KEY,
    }
    cluster = LocalRayCluster(root / "ray", env)
    try:
        cluster.start_head()
        cluster.add_worker("worker-a", resources=WORKER)
        cluster.add_worker("worker-b", resources=WORKER)
        args = {
            "model": "tiny-llama",
            "replicas": 2,
            "cpus_per_replica": 1,
            "gpus_per_replica": 0,
            "worker_resources": WORKER,
            "http_host": "127.0.0.1",
            "http_port": free_port(),
            "grpc_port": free_port(),
            "data_dir": str(root / "data"),
            "max_prompt_tokens": 3000,
            "max_batch": 4,
            "max_ongoing_requests": 8,
            "max_queued_requests": 32,
            "overload_queue_len": 8,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "defaults": {"policy": "snapkv", **SNAPKV},
        }
        began = time.monotonic()
        cluster.run_driver(DEPLOY, {"MN_CONFIG": json.dumps(serve_config(args, 2))}, timeout_s=300)
        started = ", ".join(f"{n.name} {n.started_s:.1f}s" for n in cluster.nodes.values())
        print(f"\n[multinode] nodes started in {started}; app deployed in {time.monotonic() - began:.1f} s")
        twin = Engine(load_model("tiny-llama"), prefill_chunk=1024)  # the service's prefill_chunk (default)
        yield MultiNode(cluster, store, f"http://127.0.0.1:{args['http_port']}", args, twin)
    finally:
        cluster.shutdown()
        store.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_sessions_spread_over_the_worker_nodes_and_follow_ups_stay_on_their_holder(mn):
    placement = mn.cluster.replicas_by_node()
    assert placement["head"] == [] and len(placement["worker-a"]) == 1 and len(placement["worker-b"]) == 1
    assert mn.cluster.node_of_actor_named("#Ingress#") == "head"  # the ingress on the (on-demand) head
    # Redis is the external one, with a password: the directory is there, and closed without it
    plain = redis.Redis(host="127.0.0.1", port=mn.redis.port)
    with pytest.raises(redis.AuthenticationError):
        plain.ping()

    sessions = [mn.open(f"spread-{i}", i) for i in range(8)]
    holder = {}
    for s in sessions:
        answer, _, _ = ask(mn, s)
        holder[s.sid] = answer["worker"]
        assert answer["source"] == "device"
    nodes = mn.worker_nodes()
    assert {nodes[w] for w in holder.values()} == {"worker-a", "worker-b"}  # spread over both nodes
    for s in sessions:
        answer, _, _ = ask(mn, s)
        assert answer["worker"] == holder[s.sid] and answer["source"] == "device"  # on its holder
    keys = redis.Redis.from_url(mn.redis.url).keys(f"*{TENANT}*")
    assert keys, "the session directory is in the external Redis"


def test_spot_preemption_drains_through_ray_and_moves_every_session(mn):
    from kvsnap.cluster.spot import draining_nodes

    sessions = [mn.open(f"spot-{i}", i) for i in range(8)]
    for s in sessions:
        ask(mn, s)
    nodes = mn.worker_nodes()
    on = {s.sid: nodes[s.answers[-1]["worker"]] for s in sessions}
    victim = max(("worker-a", "worker-b"), key=lambda n: sum(v == n for v in on.values()))
    survivor = next(n for n in ("worker-a", "worker-b") if n != victim)
    moving = [s for s in sessions if on[s.sid] == victim]
    staying = [s for s in sessions if on[s.sid] == survivor]
    held = {w for w, n in nodes.items() if n == victim}
    assert moving and len(held) == 1

    metadata = FakeMetadata()
    watcher = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("kvsnap")),
            "spot-watch",
            f"--ray-address={mn.cluster.gcs_address}",
            f"--node-ip-address={mn.cluster.nodes[victim].ip}",  # the watcher runs on the victim node
            f"--kvsnap-url={mn.http}",
            f"--admin-key={ADMIN_KEY}",
            f"--metadata-url={metadata.url}",
            "--interval=0.5",
        ],
        env=mn.cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = watcher.stdout.readline()
        assert first.startswith("watching") and mn.cluster.nodes[victim].node_id in first, first
        time.sleep(1.0)  # it polls; no notice yet
        assert watcher.poll() is None
        notice_at = time.monotonic()
        metadata.announce(seconds=120)
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
        metadata.server.shutdown()
    drained_s = time.monotonic() - notice_at
    assert watcher.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["node"] == mn.cluster.nodes[victim].node_id
    # the replicas it found through Ray are the ones on its node; each handed its sessions over
    # (these and the earlier tests' sessions it held)
    assert set(report["drained"]) == held and sum(report["drained"].values()) >= len(moving), (report, err[-2000:])
    deadline_ms = draining_nodes(mn.cluster.gcs_address).get(mn.cluster.nodes[victim].node_id)
    assert deadline_ms is not None and 60_000 < deadline_ms - time.time() * 1000 <= 120_000  # Ray drains it

    # the move: half of the moved sessions ask while the node is still up (draining), then the
    # node is reclaimed (every process killed), then the rest ask; the others ask throughout
    latencies, sources = [], {}
    half = len(moving) // 2
    for s in moving[:half] + staying:
        answer, took, _ = ask(mn, s)
        latencies.append(took)
        sources[s.sid] = answer["source"]
    mn.cluster.kill(victim)
    killed_at = time.monotonic()
    for s in moving[half:]:
        answer, took, _ = ask(mn, s)
        latencies.append(took)
        sources[s.sid] = answer["source"]
    survivor_ids = {w for w, n in mn.worker_nodes().items() if n == survivor}
    for s in sessions:
        assert s.answers[-1]["worker"] in survivor_ids, (s.sid, s.answers[-1])
    moved_sources = [sources[s.sid] for s in moving]
    imported, rebuilt = moved_sources.count("imported"), moved_sources.count("rebuilt")
    assert imported + rebuilt == len(moving) and imported >= 1, moved_sources
    assert all(sources[s.sid] == "device" for s in staying)  # sessions of the surviving node stay put
    print(
        f"\n[multinode] spot: watcher drained {report['drained']} {drained_s:.1f} s after the notice; "
        f"moved {len(moving)} sessions: {imported} imported, {rebuilt} rebuilt; {len(staying)} stayed; "
        f"worst turn latency during the move {max(latencies):.2f} s "
        f"(median {sorted(latencies)[len(latencies) // 2]:.2f} s)"
    )

    # every session goes on answering on the survivor, from its device tier
    for s in sessions:
        answer, _, _ = ask(mn, s)
        assert answer["source"] == "device" and answer["worker"] in survivor_ids
    # capacity returns: a new node joins, Serve places the replacement replica there
    mn.cluster.add_worker("worker-c", resources=WORKER)
    took = mn.wait_for_workers(2)
    placement = mn.cluster.replicas_by_node()
    assert len(placement["worker-c"]) == 1 and len(placement[survivor]) == 1
    print(
        f"[multinode] spot: 2 worker replicas again {time.monotonic() - killed_at:.1f} s after the reclaim "
        f"({took:.1f} s after the new node joined)"
    )


def test_a_node_lost_without_notice_its_sessions_are_rebuilt_on_the_survivor(mn):
    alive = [n for n, node in mn.cluster.nodes.items() if node.alive and n != "head"]
    assert len(alive) == 2
    sessions = [mn.open(f"lost-{i}", i) for i in range(6)]
    for s in sessions:
        ask(mn, s)
    nodes = mn.worker_nodes()
    on = {s.sid: nodes[s.answers[-1]["worker"]] for s in sessions}
    victim = max(alive, key=lambda n: sum(v == n for v in on.values()))
    survivor = next(n for n in alive if n != victim)
    lost = [s for s in sessions if on[s.sid] == victim]
    assert lost

    mn.cluster.kill(victim)  # no notice: every process of the node, at once
    killed_at = time.monotonic()
    detected = {}
    watch = threading.Thread(target=lambda: detected.setdefault("s", mn.cluster.wait_node_dead(victim, 90)))
    watch.start()
    with ThreadPoolExecutor(len(sessions)) as pool:
        results = list(pool.map(lambda s: ask(mn, s), sessions))
    watch.join()
    attempts = [a for _, _, tries in results for a in tries]
    assert all(a.status > 0 and a.took_s < REQUEST_TIMEOUT_S + 5 for a in attempts), attempts  # nothing hung
    survivor_ids = {w for w, n in mn.worker_nodes().items() if n == survivor}
    for s in sessions:
        assert s.answers[-1]["worker"] in survivor_ids
        assert s.answers[-1]["source"] == ("rebuilt" if s in lost else "device"), (s.sid, s.answers[-1])
    failed = [a for a in attempts if a.status != 200]
    errors_for = max((a.began + a.took_s for a in failed), default=killed_at) - killed_at
    worst = max(took for _, took, _ in results)
    print(
        f"\n[multinode] lost node: {len(lost)} sessions rebuilt on the survivor, {len(sessions) - len(lost)} stayed; "
        f"Ray declared the node dead after {detected['s']:.1f} s; {len(failed)} failed attempts "
        f"({sorted({a.status for a in failed})}), errors until {errors_for:.1f} s after the kill; "
        f"worst turn {worst:.1f} s from its first try; longest single request {max(a.took_s for a in attempts):.1f} s"
    )

    # capacity returns: Serve brings the replica count back on a new node
    mn.cluster.add_worker("worker-d", resources=WORKER)
    took = mn.wait_for_workers(2)
    assert len(mn.cluster.replicas_by_node()["worker-d"]) == 1
    print(f"[multinode] lost node: 2 worker replicas again {took:.1f} s after the new node joined")
    for s in sessions:  # and the sessions go on where they are
        answer, _, _ = ask(mn, s)
        assert answer["worker"] in survivor_ids and answer["source"] == "device"


def test_scaling_out_new_sessions_go_to_the_new_node_and_held_ones_stay(mn):
    """The operator's scale-out: a node joins, the same Serve config is deployed again with one
    more worker replica under ``deployments:`` (cluster/serve.yaml). Serve starts the new replica
    on the new node and keeps the running ones (a light update: same ids, same caches); held
    sessions answer on their holder from its device tier, new sessions are placed on the least
    loaded replica, which is the new, empty one."""
    before = mn.worker_nodes()
    assert len(before) == 2
    held = [mn.open(f"held-{i}", i) for i in range(4)]
    holder = {s.sid: ask(mn, s)[0]["worker"] for s in held}
    assert set(holder.values()) <= set(before)

    joined_at = time.monotonic()
    mn.cluster.add_worker("worker-e", resources=WORKER)
    deployed = mn.deploy(3)
    took = mn.wait_for_workers(3)
    after = mn.worker_nodes()
    assert set(before) <= set(after), (before, after)  # the running replicas stayed (same replica ids)
    (new_id,) = set(after) - set(before)
    assert after[new_id] == "worker-e"
    print(
        f"\n[multinode] scale-out: 3 worker replicas {time.monotonic() - joined_at:.1f} s after the node joined "
        f"(deploy {deployed:.1f} s, then {took:.1f} s)"
    )

    for s in held:  # held sessions stay where their KV is
        answer, _, _ = ask(mn, s)
        assert answer["worker"] == holder[s.sid] and answer["source"] == "device", (s.sid, answer)
    fresh = [mn.open(f"scaled-{i}", i) for i in range(3)]
    placed = [ask(mn, s)[0] for s in fresh]
    # the old replicas hold this module's earlier sessions, the new one none: every new session goes there
    assert [a["worker"] for a in placed] == [new_id] * len(fresh), (new_id, placed)
    assert all(a["source"] == "device" for a in placed)
