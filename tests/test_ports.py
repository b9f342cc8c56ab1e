"""`free_port`: the kernel's choice by default, a range of its own under SPECMESH_PORT_RANGE (what keeps
the test suite's xdist workers off each other's ports)."""
from __future__ import annotations

import socket

import pytest

from specmesh_cli import ports


def test_ports_come_from_the_range_and_are_not_handed_out_twice(monkeypatch):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "23400-23419")
    monkeypatch.setattr(ports, "_handed", set())
    with socket.socket() as held:     # one port of the range bound by someone else: never handed out
        held.bind(("127.0.0.1", 23405))
        got = [ports.free_port() for _ in range(19)]
        assert sorted(got) == [port for port in range(23400, 23420) if port != 23405]
        with pytest.raises(RuntimeError, match="no free port left in SPECMESH_PORT_RANGE=23400-23419"):
            ports.free_port()


def test_without_a_range_the_kernel_picks(monkeypatch):
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))   # free: nothing else took it


@pytest.mark.parametrize("value", ["20000", "b-c", "30000-20000", "80-90", "60000-70000"])
def test_a_malformed_range_is_refused(monkeypatch, value):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, value)
    with pytest.raises(ValueError, match="SPECMESH_PORT_RANGE"):
        ports.free_port()
