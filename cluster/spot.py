"""Spot-preemption watcher: one per GPU worker node.

Polls the cloud's interruption notice (AWS instance metadata, IMDSv2:
``PUT /latest/api/token`` then ``GET /latest/meta-data/spot/instance-action``, which
answers 404 until AWS schedules the reclaim, about two minutes ahead). When a notice
arrives it (1) drains the Ray node through Ray's drain API (what ``ray drain-node`` calls,
with the preemption reason and the deadline), so no new replicas or tasks land there and
Serve starts replacements elsewhere, and (2) finds the kvsnap worker replicas on this node in
Ray's actor table and asks kvsnap to move their sessions to surviving replicas before the
deadline (``POST /v1/admin/workers/<id>/drain`` with an admin key: their KV is handed over
through Redis). The metadata endpoint is configurable, so tests point it at a local fake
(tests/cluster/test_multinode.py runs the whole path on a local multi-node Ray cluster).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

AWS_METADATA = "http://169.254.169.254"


@dataclass(frozen=True, slots=True)
class Notice:
    action: str  # "terminate" | "stop" | "hibernate"
    deadline: dt.datetime

    def seconds_left(self, now: dt.datetime | None = None) -> float:
        now = now or dt.datetime.now(dt.timezone.utc)
        return max(0.0, (self.deadline - now).total_seconds())


def poll_aws(metadata_url: str = AWS_METADATA, timeout_s: float = 2.0) -> Notice | None:
    """The pending interruption, or None. Raises OSError when the metadata service is unreachable."""
    token_req = urllib.request.Request(
        f"{metadata_url}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    with urllib.request.urlopen(token_req, timeout=timeout_s) as response:
        token = response.read().decode()
    req = urllib.request.Request(
        f"{metadata_url}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    deadline = dt.datetime.fromisoformat(body["time"].replace("Z", "+00:00"))
    return Notice(body.get("action", "terminate"), deadline)


def ray_drain_node(node_id: str, notice: Notice, gcs_address: str | None = None) -> None:
    """Drain the Ray node through Ray's drain API (what ``ray drain-node`` calls; the autoscaler
    uses it too), with the preemption reason and the notice's deadline: Ray places no new task or
    actor there, and Serve starts replacements elsewhere for the replicas it holds. Raises when
    Ray refuses. ``gcs_address``: the cluster's (default: the one this process's ``ray.init`` joined)."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    accepted, why = GcsClient(address=gcs_address or _gcs_address()).drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"spot {notice.action} at {notice.deadline.isoformat()}",
        int(notice.deadline.timestamp() * 1000),
    )
    if not accepted:
        raise RuntimeError(f"Ray did not accept draining node {node_id}: {why}")


def draining_nodes(gcs_address: str | None = None) -> dict[str, int]:
    """Node id -> drain deadline (ms since the epoch; 0: none) of every node Ray is draining."""
    from ray._raylet import GcsClient

    return dict(GcsClient(address=gcs_address or _gcs_address()).get_draining_nodes(timeout=10))


def local_worker_replicas(
    node_id: str, gcs_address: str | None = None, app: str = "kvsnap", deployment: str = "Worker"
) -> list[str]:
    """The ids of the kvsnap worker replicas alive on ``node_id``, read from Ray's actor table
    (the GCS; no dashboard needed): Serve names a replica's actor ``SERVE_REPLICA::<app>#<deployment>#<id>``,
    and ``<id>`` is the ``worker`` id of turn answers and of the admin drain route."""
    from ray._private.services import _get_gcs_client_options
    from ray._private.state import GlobalState

    state = GlobalState()
    state._initialize_global_state(_get_gcs_client_options(gcs_address or _gcs_address()))
    try:
        actors = state.actor_table(None, actor_state_name="ALIVE").values()
    finally:
        state.disconnect()
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(
        a["Name"][len(prefix) :] for a in actors if a["Address"]["NodeID"] == node_id and a["Name"].startswith(prefix)
    )


def _gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def drain_via_kvsnap(
    kvsnap_url: str, admin_key: str, worker_id: str, resume_after_s: float = 60.0, timeout_s: float = 60.0
) -> int:
    """Drain one replica through the admin route (an admin key: tenant keys get 403)."""
    req = urllib.request.Request(
        f"{kvsnap_url}/v1/admin/workers/{worker_id}/drain?resume_after_s={resume_after_s:.0f}",
        method="POST",
        headers={"Authorization": f"Bearer {admin_key}"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as response:
        return int(json.loads(response.read())["exported"])


@dataclass(slots=True)
class SpotWatcher:
    """Poll until a notice arrives, then drain once. Every dependency is injectable (tests)."""

    kvsnap_url: str
    admin_key: str  # one of the service's KVSNAP_ADMIN_KEYS
    poll: Callable[[], Notice | None]
    replicas: Callable[[], list[str]]
    drain_node: Callable[[Notice], None] | None = None
    interval_s: float = 5.0
    drained: dict[str, int] = field(default_factory=dict)  # worker id -> sessions exported

    def check_once(self) -> Notice | None:
        """One poll; on a notice, drain the node and move its sessions. Returns the notice."""
        try:
            notice = self.poll()
        except OSError as exc:
            log.warning("spot watcher: metadata unreachable (%s)", exc)
            return None
        if notice is None:
            return None
        log.warning("spot watcher: %s notice, %.0f s left; draining", notice.action, notice.seconds_left())
        if self.drain_node is not None:
            try:
                self.drain_node(notice)
            except Exception as exc:  # keep going: moving the sessions matters most
                log.error("spot watcher: ray drain-node failed: %s", exc)
        try:
            replicas = self.replicas()
        except Exception as exc:
            log.error("spot watcher: could not list this node's replicas: %s", exc)
            replicas = []
        log.warning("spot watcher: kvsnap worker replicas on this node: %s", replicas)
        for worker_id in replicas:
            try:
                # out of placement until well after the reclaim; back in if the node survives after all
                self.drained[worker_id] = drain_via_kvsnap(
                    self.kvsnap_url,
                    self.admin_key,
                    worker_id,
                    resume_after_s=notice.seconds_left() + 60,
                    timeout_s=max(5.0, notice.seconds_left()),
                )
            except OSError as exc:
                log.error("spot watcher: draining worker %s failed: %s", worker_id, exc)
        log.warning("spot watcher: drained %s", self.drained)
        return notice

    @classmethod
    def for_node(
        cls,
        node_id: str,
        gcs_address: str,
        kvsnap_url: str,
        admin_key: str,
        metadata_url: str = AWS_METADATA,
        interval_s: float = 5.0,
    ) -> SpotWatcher:
        """The watcher of one Ray node (``kvsnap spot-watch``): AWS's notice at ``metadata_url``,
        the node's kvsnap worker replicas from Ray's actor table, Ray's drain API."""
        return cls(
            kvsnap_url=kvsnap_url,
            admin_key=admin_key,
            poll=functools.partial(poll_aws, metadata_url),
            replicas=functools.partial(local_worker_replicas, node_id, gcs_address),
            drain_node=lambda notice: ray_drain_node(node_id, notice, gcs_address),
            interval_s=interval_s,
        )

    def run(self, stop_after_notice: bool = True) -> None:
        while True:
            if self.check_once() is not None and stop_after_notice:
                return
            time.sleep(self.interval_s)
