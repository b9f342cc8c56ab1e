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
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from specmesh.tls import ChannelTLS
from specmesh_cli.children import die_with_parent
from specmesh_cli.ports import free_port


def find_redis_server() -> str:
    candidates = [Path(sys.executable).parent / "redis-server", shutil.which("redis-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server binary found: install one (Debian/Ubuntu: apt-get install redis-server) "
        "or point REDIS_URL at an existing Redis")


class EmbeddedRedis:
    """A redis-server child. With `tls` (its certificate, key and CA) it speaks only TLS and the URL is
    `rediss://...?ssl_ca_certs=<CA>`; with `password` it requires AUTH (the URL carries it)."""

    def __init__(self, port: int | None = None, tls: ChannelTLS | None = None, password: str | None = None):
        self.port = port or free_port()
        self.tls, self.password = tls, password
        auth = f":{quote(password, safe='')}@" if password else ""
        self.url = (f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(tls.ca_file)}" if tls
                    else f"redis://{auth}127.0.0.1:{self.port}/0")
        self._dir = tempfile.TemporaryDirectory(prefix="specmesh-redis-")
        self.process: subprocess.Popen | None = None

    def again(self) -> "EmbeddedRedis":
        """A new server like this one, on the same port (a restart)."""
        return EmbeddedRedis(self.port, self.tls, self.password)

    def _args(self) -> list[str]:
        args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                "--loglevel", "warning"]
        if self.tls:
            # Clients prove nothing with a certificate here: the password is their credential.
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls.cert_file,
                     "--tls-key-file", self.tls.key_file, "--tls-ca-cert-file", self.tls.ca_file,
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:   # on the command line only in tests and `specmesh up`: this machine's own processes
            args += ["--requirepass", self.password]
        return args

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
            conn = raw
            if self.tls:
                conn = ssl.create_default_context(cafile=self.tls.ca_file).wrap_socket(raw, server_hostname="127.0.0.1")
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self.process = subprocess.Popen(
            [find_redis_server(), *self._args()],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=die_with_parent(signal.SIGKILL))   # nothing to drain: sessions are rebuildable
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.process.stderr.read().decode(errors='replace')}")
            try:
                if self._answers():
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
