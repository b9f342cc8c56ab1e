"""Free loopback ports for the services `specmesh up`, the bench and the tests start.

A port found free is only free until someone binds it: the service that will use it binds seconds later,
after its imports. Two things keep that window harmless:
- the services refuse a port already bound (`specmesh.server`: gRPC's SO_REUSEPORT is off), so a clash
  ends a start-up with "could not bind", never two servers sharing one port;
- `SPECMESH_PORT_RANGE=LOW-HIGH` draws ports from that range only. Processes that start services side by
  side (the test suite's xdist workers: tests/conftest.py) each get a range of their own, and a range
  below the kernel's ephemeral ports (/proc/sys/net/ipv4/ip_local_port_range) is not handed out to
  outgoing connections either. Unset, the kernel picks (bind to port 0).
"""
from __future__ import annotations

import os
import random
import socket

PORT_RANGE_ENV = "SPECMESH_PORT_RANGE"

# Ports this process has handed out: a range is drawn at random, and a port handed out but not bound yet
# would look free again.
_handed: set[int] = set()
# Not the `random` module's state: a test that seeds it would make every process draw the same ports.
_draw = random.SystemRandom()


def port_range() -> range | None:
    """The range `SPECMESH_PORT_RANGE` names, or None when unset; a malformed value is an error."""
    value = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not value:
        return None
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, e.g. 20000-22999") from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected 1024 <= LOW <= HIGH <= 65535")
    return range(low, high + 1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing is bound to now (see the module's note on the window before it is bound)."""
    ports = port_range()
    if ports is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        candidates = [port for port in ports if port not in _handed]
        _draw.shuffle(candidates)
        port = next((port for port in candidates if _bindable(port)), None)
        if port is None:
            raise RuntimeError(f"no free port left in {PORT_RANGE_ENV}={os.environ[PORT_RANGE_ENV]}")
    _handed.add(port)
    return port
