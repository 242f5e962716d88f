"""A multi-node Ray cluster on this one host, for tests: every node is started by ``ray start``,
as ``cluster/aws.yaml`` starts them, each in a process group of its own so that it can be
killed whole, as a spot reclaim does. Each node has its own loopback address (127.0.0.2, ...),
so a process can join one chosen node (``ray.init(_node_ip_address=...)``), as a process on a
cluster node joins its own.

Nothing here is a Ray driver: the test process may be one of another (local) Ray already. The
cluster is read through its GCS (node table, draining nodes, actors) and driven by child
processes (``serve run``-like deploys, ``kvsnap spot-watch``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvsnap.ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))


@dataclass
class Node:
    name: str
    ip: str
    session: int  # the process session of its processes (`ray start` led it)
    resources: dict[str, float]
    node_id: str = ""
    started_s: float = 0.0  # how long `ray start` took
    alive: bool = True


@dataclass
class LocalRayCluster:
    root: Path  # short: Ray's socket paths live under it (108 characters at most)
    env: dict[str, str]
    nodes: dict[str, Node] = field(default_factory=dict)
    gcs_address: str = ""
    _next_ip: int = 2

    # -- nodes ---------------------------------------------------------------------------
    def start_head(self, num_cpus: int = 1) -> Node:
        # the head takes the host's address (Ray replaces 127.0.0.1 with it anyway)
        role = ["--head", f"--port={free_port()}", "--include-dashboard=false", f"--dashboard-port={free_port()}"]
        return self._start("head", None, role, num_cpus, {})

    def add_worker(self, name: str, num_cpus: int = 1, resources: dict[str, float] | None = None) -> Node:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        return self._start(name, ip, [f"--address={self.gcs_address}"], num_cpus, resources or {})

    def _start(self, name: str, ip: str | None, role: list[str], num_cpus: int, resources: dict[str, float]) -> Node:
        args = [
            RAY,
            "start",
            *role,
            *([f"--node-ip-address={ip}"] if ip else []),
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--temp-dir={self.root}",
            "--object-store-memory=100000000",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            "--disable-usage-stats",
            "--log-style=record",
        ]
        began = time.monotonic()
        # a process session of its own: every process of the node stays in it
        proc = subprocess.Popen(
            args,
            env=self.env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        node = self.nodes[name] = Node(name, ip or "", proc.pid, resources)  # killed at shutdown, whatever happens
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start ({name}) failed:\n{out[-3000:]}")
        if not ip:  # the head: `ray start` wrote the GCS address it chose into the temp dir
            self.gcs_address = (self.root / "ray_current_cluster").read_text().strip()
            node.ip = self.gcs_address.rsplit(":", 1)[0]
        node.node_id = self._wait_for_node(node.ip)
        node.started_s = time.monotonic() - began
        return node

    def _wait_for_node(self, ip: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = {n["NodeManagerAddress"]: n["NodeID"] for n in self.node_table() if n["Alive"]}
            if ip in alive:
                return alive[ip]
            time.sleep(0.2)
        raise TimeoutError(f"no Ray node at {ip} joined within {timeout_s} s")

    def kill(self, name: str) -> None:
        """SIGKILL every process of the node (raylet, agents, workers, replicas): a reclaim. They
        share the session `ray start` began (worker processes get process groups of their own)."""
        node = self.nodes[name]
        for pid in node_processes(node.session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.alive = False

    def shutdown(self) -> None:
        for name in reversed(list(self.nodes)):  # workers first, the head (GCS) last
            self.kill(name)

    # -- reading the cluster (its GCS; this process is no driver of it) ------------------
    def _state(self):
        from ray._private.services import _get_gcs_client_options
        from ray._private.state import GlobalState

        state = GlobalState()
        state._initialize_global_state(_get_gcs_client_options(self.gcs_address))
        return state

    def node_table(self) -> list[dict]:
        state = self._state()
        try:
            return state.node_table()
        finally:
            state.disconnect()

    def node_alive(self, name: str) -> bool:
        node_id = self.nodes[name].node_id
        return any(n["NodeID"] == node_id and n["Alive"] for n in self.node_table())

    def wait_node_dead(self, name: str, timeout_s: float = 60) -> float:
        """Seconds until Ray's GCS declares the (killed) node dead."""
        began = time.monotonic()
        while self.node_alive(name):
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"Ray still thinks node {name} is alive after {timeout_s} s")
            time.sleep(0.2)
        return time.monotonic() - began

    def replicas_by_node(self, app: str = "kvsnap", deployment: str = "Worker") -> dict[str, list[str]]:
        """Node name -> ids of the worker replicas alive on it (Ray's actor table)."""
        from kvsnap.cluster.spot import local_worker_replicas

        return {
            name: local_worker_replicas(node.node_id, self.gcs_address, app, deployment)
            for name, node in self.nodes.items()
            if node.alive
        }

    def node_of_actor_named(self, fragment: str) -> str | None:
        """The node (name) an alive actor whose name holds ``fragment`` runs on."""
        state = self._state()
        try:
            actors = state.actor_table(None, actor_state_name="ALIVE").values()
        finally:
            state.disconnect()
        by_id = {node.node_id: name for name, node in self.nodes.items()}
        for actor in actors:
            if fragment in actor["Name"]:
                return by_id.get(actor["Address"]["NodeID"])
        return None

    # -- drivers: child processes that join the cluster ----------------------------------
    def run_driver(self, code: str, env: dict[str, str] | None = None, timeout_s: float = 180) -> str:
        """Run Python ``code`` in a child process (``GCS`` holds the cluster's address); its stdout."""
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=self.env | (env or {}) | {"GCS": self.gcs_address},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"driver failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return done.stdout


def node_processes(session: int) -> list[int]:
    """Pids of the live processes in the process session ``session``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == session:
                    pids.append(int(entry))
    return pids
