"""An embedded Redis for `specmesh up` and the tests, when REDIS_URL names none.

Runs the `redis-server` binary found on PATH (Debian's package, or one that a
pip package put in the virtualenv's bin/) on a free loopback port, without
persistence: sessions are rebuildable state with a TTL.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specmesh_cli.children import die_with_parent


def find_redis_server() -> str:
    candidates = [Path(sys.executable).parent / "redis-server", shutil.which("redis-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server binary found: install one (Debian/Ubuntu: apt-get install redis-server) "
        "or point REDIS_URL at an existing Redis")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="specmesh-redis-")
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self.process = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=die_with_parent(signal.SIGKILL))   # nothing to drain: sessions are rebuildable
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.process.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._dir.cleanup()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
