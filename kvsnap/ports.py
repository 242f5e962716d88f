"""Free TCP ports for the listeners kvsnap starts on one machine (embedded Redis, the local
Serve app's HTTP / gRPC ports, HAProxy's metrics and stats pages, a local test cluster).

A port the kernel hands out for ``bind(("", 0))`` comes from the ephemeral range, the same
range every outgoing connection takes its local port from. Between choosing such a port and
the listener binding it (for HAProxy: the whole start of Ray, many seconds) a Ray process's
connection can take it, and the listener fails with "Address already in use". So the port is
drawn at random from below the ephemeral range and above Ray's worker ports (10002-19999 by
default), where nothing takes a port unasked, and checked free on every interface.
"""

from __future__ import annotations

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


_handed_out: set[int] = set()  # this process's draws, bound or not yet: never handed out twice
_lock = threading.Lock()


def free_port(tries: int = 200) -> int:
    """A port no listener holds now, outside the ephemeral range where it can be."""
    high = ephemeral_low()
    with _lock:
        for _ in range(tries if high - LOW > 1000 else 0):
            port = random.randrange(LOW, high)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
        with socket.socket() as s:  # a machine whose ephemeral range starts low: the kernel's choice
            s.bind(("", 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # all interfaces: HAProxy and Ray bind 0.0.0.0
        except OSError:
            return False
    return True
