"""The supervising launcher: a child that dies is restarted, and no child
outlives the process that started it, whatever signal kills that process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from specmesh.client import Client
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tests.conftest import SERVING, health_status

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie is dead, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def _serving(address: str, service: str) -> bool:
    try:
        return health_status(address, service) == SERVING
    except grpc.RpcError:   # not listening yet
        return False


def test_a_dead_replica_is_restarted_and_serves_again(tiny_models, redis_url, tmp_path):
    with Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                 redis_url=redis_url, log_dir=tmp_path, startup_timeout_s=900, host="127.0.0.1") as cluster:
        old = cluster.processes["draft-0"].pid
        cluster.processes["draft-0"].kill()
        cluster.processes["draft-0"].wait()
        assert cluster.supervise() == ["draft-0"]
        assert cluster.processes["draft-0"].pid != old
        deadline = time.monotonic() + 300
        while not _serving(f"localhost:{cluster.draft_port}", "specmesh.v1.Draft"):
            assert time.monotonic() < deadline, "the restarted draft never served"
            time.sleep(0.5)
        assert cluster.supervise() == []   # nothing else died
        with Client(cluster.address) as client:
            assert client.generate("still here", max_new_tokens=8, k=3, drafter="model").finish_reason == "length"


def test_children_die_with_the_launcher_even_on_sigkill(tiny_models, tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from specmesh_cli.launcher import Cluster
        from specmesh_cli.ports import free_port
        cluster = Cluster(model={str(tiny_models["target"])!r}, port=free_port(), log_dir=Path({str(tmp_path)!r}),
                          startup_timeout_s=900).start()   # its own embedded redis-server too
        print(json.dumps([p.pid for p in cluster.processes.values()] + [cluster.redis.process.pid]), flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        children = json.loads(launcher.stdout.readline())
        assert len(children) == 4 and all(_alive(pid) for pid in children)
        launcher.send_signal(signal.SIGKILL)   # no cleanup code runs in the launcher
        launcher.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        launcher.kill()
