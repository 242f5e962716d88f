"""Free TCP ports for the listeners kvsnap starts on one machine (embedded Redis, the local
Serve app's HTTP / gRPC ports, HAProxy's metrics and stats pages, a local test cluster).

A port the kernel hands out for ``bind(("", 0))`` comes from the ephemeral range, the same
range every outgoing connection takes its local port from. Between choosing such a port and
the listener binding it (for HAProxy: the whole start of Ray, many seconds) a Ray process's
connection can take it, and the listener fails with "Address already in use". So the port is
drawn at random from below the ephemeral range and above Ray's worker ports (10002-19999 by
default), where nothing takes a port unasked, and checked free on every interface.

Nothing but Ray Serve's direct ingress: each ingress replica of every local Serve app takes
ports of its own from fixed ranges (HTTP 30000-31000, gRPC 40000-41000 by default), so a port
drawn there can be taken by another local service's replica before this one binds it; a client
of this service then reaches the other one (a test suite saw its own API key refused, HTTP 401).
Those ranges are never drawn.
"""

from __future__ import annotations

import os
import random
import socket
import threading

# Above Ray's default worker ports (--min-worker-port 10002 / --max-worker-port 19999).
LOW = 20000


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it can't be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


DIRECT_INGRESS = (("HTTP", 30000, 31000), ("GRPC", 40000, 41000))  # Serve's default replica port ranges


def serve_replica_ports() -> list[range]:
    """The port ranges Ray Serve's direct ingress hands its replicas: its defaults, and the
    RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_{HTTP,GRPC}_PORT a local Ray is given."""
    ranges = [range(low, high + 1) for _, low, high in DIRECT_INGRESS]
    for proto, _, _ in DIRECT_INGRESS:
        try:
            low = int(os.environ[f"RAY_SERVE_DIRECT_INGRESS_MIN_{proto}_PORT"])
            high = int(os.environ[f"RAY_SERVE_DIRECT_INGRESS_MAX_{proto}_PORT"])
        except (KeyError, ValueError):
            continue
        ranges.append(range(low, high + 1))
    return ranges


_handed_out: set[int] = set()  # this process's draws, bound or not yet: never handed out twice
_lock = threading.Lock()


def free_port(tries: int = 200) -> int:
    """A port no listener holds now, outside the ephemeral range where it can be."""
    high, taken = ephemeral_low(), serve_replica_ports()
    with _lock:
        for _ in range(tries if high - LOW > 1000 else 0):
            port = random.randrange(LOW, high)
            if port not in _handed_out and not any(port in r for r in taken) and _bindable(port):
                _handed_out.add(port)
                return port
        with socket.socket() as s:  # a machine whose ephemeral range starts low: the kernel's choice
            s.bind(("", 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port


def free_block(size: int, tries: int = 200) -> int:
    """The first of ``size`` consecutive ports that no listener holds now, drawn like
    :func:`free_port` (a local Serve app's replica port range)."""
    high, taken = ephemeral_low(), serve_replica_ports()
    with _lock:
        for _ in range(tries if high - LOW > 10 * size else 0):
            low = random.randrange(LOW, high - size)
            block = range(low, low + size)
            clash = any(p in _handed_out or any(p in r for r in taken) for p in block)
            if not clash and all(_bindable(p) for p in block):
                _handed_out.update(block)
                return low
    raise RuntimeError(f"no {size} consecutive free ports between {LOW} and {high}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # all interfaces: HAProxy and Ray bind 0.0.0.0
        except OSError:
            return False
    return True
