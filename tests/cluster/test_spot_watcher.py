"""The spot watcher (cluster/spot.py): it drains on a notice from a local fake metadata server
(and only then), and the drained replica's sessions move. tests/cluster/test_multinode.py runs the
whole path on a multi-node cluster with the same fake (``FakeMetadata``)."""

from __future__ import annotations

import datetime as dt
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvsnap.cluster.spot import Notice, SpotWatcher, poll_aws

from ..conftest import ADMIN_KEY
from ..service.helpers import DOC, FULL, create, kill_replica, reference_answers, turn, wait_for_workers


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
    soon = Notice("terminate", dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=120))
    tenant_watcher = SpotWatcher(service.http, "key-alpha", poll=lambda: soon, replicas=lambda: [victim])
    assert tenant_watcher.check_once() is soon and tenant_watcher.drained == {}  # a tenant key drains nothing (403)
    drained_nodes = []
    watcher = SpotWatcher(
        service.http,
        ADMIN_KEY,
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
