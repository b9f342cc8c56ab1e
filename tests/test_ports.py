"""`free_port`: the kernel's choice by default, a range of its own under SPECMESH_PORT_RANGE (what keeps
the test suite's xdist workers off each other's ports)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specmesh_cli import ports

REPO = Path(__file__).resolve().parent.parent


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


def test_each_xdist_worker_draws_from_a_range_of_its_own(tmp_path):
    """tests/conftest.py's ranges, in a pytest run of its own on two workers. (xdist's controller sets
    none: its workers would inherit it and share one range.)"""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\n" + "".join(
        f"def test_{i}():\n    with open(os.path.join(os.environ['PROBE_OUT'], os.environ['PYTEST_XDIST_WORKER']), 'w') as f:\n"
        f"        f.write(os.environ['{ports.PORT_RANGE_ENV}'])\n" for i in range(8)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != ports.PORT_RANGE_ENV}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-n", "2", "--dist", "load", str(probe)], cwd=REPO, env={**env, "PROBE_OUT": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    ranges = {}
    for worker in ("gw0", "gw1"):
        low, high = map(int, (tmp_path / worker).read_text().split("-"))
        ranges[worker] = range(low, high + 1)
    assert not set(ranges["gw0"]) & set(ranges["gw1"])
    assert all(20000 <= r.start and r.stop <= 32768 and len(r) > 1000 for r in ranges.values())
