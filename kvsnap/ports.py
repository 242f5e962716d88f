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
Those ranges are never drawn, nor the ranges an ancestor process drew for its own local Serve
app (RESERVED_ENV): a replica binds its port with SO_REUSEPORT, so a grandchild's replica on a
port of its grandparent's range shares it, and the kernel splits the connections between them.
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
# the variables that give a local Ray other ranges: protocol -> (first port's, last port's)
DIRECT_INGRESS_ENV = {
    proto: (f"RAY_SERVE_DIRECT_INGRESS_MIN_{proto}_PORT", f"RAY_SERVE_DIRECT_INGRESS_MAX_{proto}_PORT")
    for proto, _, _ in DIRECT_INGRESS
}

# "low-high,low-high": the replica port ranges this process's ancestors drew (and it inherited),
# each process adding the ones it was given before it draws its own
RESERVED_ENV = "KVSNAP_RESERVED_PORT_RANGES"


def serve_replica_ports() -> list[range]:
    """The port ranges Ray Serve's direct ingress hands its replicas: its defaults, the ranges a
    local Ray is given (DIRECT_INGRESS_ENV) and the ones this process's ancestors drew (RESERVED_ENV)."""
    ranges = [range(low, high + 1) for _, low, high in DIRECT_INGRESS]
    for low_key, high_key in DIRECT_INGRESS_ENV.values():
        try:
            ranges.append(range(int(os.environ[low_key]), int(os.environ[high_key]) + 1))
        except (KeyError, ValueError):
            continue
    return ranges + _reserved(os.environ.get(RESERVED_ENV, ""))


def reserve_inherited() -> str:
    """RESERVED_ENV's value for a process about to draw replica ranges of its own: the reserved
    ranges it inherited plus the DIRECT_INGRESS_ENV ranges it was given, so that none of its
    descendants draws a range an ancestor's Serve app may still use."""
    ranges = {(r.start, r.stop - 1) for r in serve_replica_ports()[len(DIRECT_INGRESS) :]}
    return ",".join(f"{low}-{high}" for low, high in sorted(ranges))


def _reserved(value: str) -> list[range]:
    ranges = []
    for item in filter(None, value.split(",")):
        low, _, high = item.partition("-")
        try:
            ranges.append(range(int(low), int(high) + 1))
        except ValueError:
            continue  # a hand-edited value: the entries that parse still count
    return ranges


_handed_out: set[int] = set()  # this process's draws, bound or not yet: never handed out twice
_lock = threading.Lock()


def free_port(tries: int = 200) -> int:
    """A port no listener holds now, outside the ephemeral range where it can be."""
    with _lock:
        port = _draw(1, tries, room=1000)
        if port is None:  # a machine whose ephemeral range starts low: the kernel's choice
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            _handed_out.add(port)
        return port


def free_block(size: int, tries: int = 200) -> int:
    """The first of ``size`` consecutive ports that no listener holds now, drawn like
    :func:`free_port` (a local Serve app's replica port range)."""
    with _lock:
        low = _draw(size, tries, room=10 * size)
    if low is None:
        raise RuntimeError(f"no {size} consecutive free ports between {LOW} and {ephemeral_low()}")
    return low


def _draw(size: int, tries: int, room: int) -> int | None:
    """The first of ``size`` consecutive ports drawn at random between LOW and the ephemeral range,
    none handed out before, in Serve's replica ranges or held now (None after ``tries`` draws, or
    at once where the span is ``room`` ports or less). The caller holds ``_lock``."""
    high, taken = ephemeral_low(), serve_replica_ports()
    for _ in range(tries if high - LOW > room else 0):
        low = random.randrange(LOW, high - size + 1)
        block = range(low, low + size)
        clash = any(p in _handed_out or any(p in r for r in taken) for p in block)
        if not clash and all(_bindable(p) for p in block):
            _handed_out.update(block)
            return low
    return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # all interfaces: HAProxy and Ray bind 0.0.0.0
        except OSError:
            return False
    return True
