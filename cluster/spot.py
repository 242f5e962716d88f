"""Spot-preemption watcher: one per GPU worker node.

Polls the cloud's interruption notice (AWS instance metadata, IMDSv2:
``PUT /latest/api/token`` then ``GET /latest/meta-data/spot/instance-action``, which
answers 404 until AWS schedules the reclaim, about two minutes ahead). When a notice
arrives it (1) drains the Ray node (``ray drain-node`` with the preemption reason and
the deadline), so no new replicas or tasks land there, and (2) asks kvsnap to move the
sessions held by the worker replicas on this node to surviving replicas before the
deadline (``POST /v1/admin/workers/<id>/drain``: their KV is handed over through Redis).
The metadata endpoint is configurable, so tests point it at a local fake.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
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


def ray_drain_node(node_id: str, notice: Notice) -> None:
    """``ray drain-node`` with the preemption reason; Ray stops placing work on the node."""
    subprocess.run(
        [
            "ray",
            "drain-node",
            "--node-id",
            node_id,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            f"spot {notice.action} at {notice.deadline.isoformat()}",
            "--deadline-remaining-seconds",
            str(int(notice.seconds_left())),
        ],
        check=True,
        timeout=60,
    )


def local_worker_replicas(node_id: str) -> list[str]:
    """kvsnap worker replica ids whose actors run on ``node_id``."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")], limit=1000)
    ids = []
    for actor in actors:
        name = actor.name or ""
        if name.startswith("SERVE_REPLICA::") and "#Worker#" in name:
            ids.append(name.rsplit("#", 1)[-1])
    return ids


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
        for worker_id in self.replicas():
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

    def run(self, stop_after_notice: bool = True) -> None:
        while True:
            if self.check_once() is not None and stop_after_notice:
                return
            time.sleep(self.interval_s)
