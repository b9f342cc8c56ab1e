"""Bring up the three tiers as separate processes on this machine (`specmesh up`).

Each tier is `specmesh serve <tier>` in its own process, talking gRPC over
loopback sockets exactly as it would across machines. Draft and verifier start
first and load their models in parallel; the orchestrator starts once both
report SERVING. Tests use the same class.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.redis_server import EmbeddedRedis, free_port

log = logging.getLogger("specmesh.launcher")


def wait_serving(address: str, service: str, process: subprocess.Popen | None, timeout_s: float,
                 describe: str = "") -> None:
    """Poll grpc.health.v1 until `service` is SERVING; fail fast if the process dies."""
    deadline = time.monotonic() + timeout_s
    last_note = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{describe or service} exited with code {process.returncode} before serving"
                                   + (f"; see {process.log_path}" if getattr(process, "log_path", None) else ""))
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() - last_note > 10:
                log.info("still waiting for %s at %s (%.0f s)", describe or service, address,
                         timeout_s - (deadline - time.monotonic()))
                last_note = time.monotonic()
            time.sleep(0.2)
    raise TimeoutError(f"{describe or service} at {address} not SERVING after {timeout_s:.0f} s")


@dataclass
class Cluster:
    model: str | None = None
    draft_model: str | None = None
    port: int = 50051
    redis_url: str | None = None
    log_dir: Path | None = None          # None: children log to this terminal
    extra_env: dict[str, str] = field(default_factory=dict)
    orchestrator_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    draft_port: int = 0
    verifier_port: int = 0
    redis: EmbeddedRedis | None = None

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    def _spawn(self, tier: str, args: list[str]) -> subprocess.Popen:
        env = {**os.environ, **self.extra_env}
        out: IO | None = None
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{tier}.log"
            out = open(log_path, "ab")
        process = subprocess.Popen([sys.executable, "-m", "specmesh.cli", "serve", tier, *args], env=env,
                                   stdout=out, stderr=subprocess.STDOUT if out else None)
        process.log_path = log_path
        self.processes[tier] = process
        return process

    def start_tier(self, tier: str) -> None:
        """(Re)start one tier on its port; used at start-up and by failure tests."""
        if tier == "draft":
            args = ["--port", str(self.draft_port)] + (["--draft-model", self.draft_model] if self.draft_model else [])
            service = "specmesh.v1.Draft"
            port = self.draft_port
        elif tier == "verifier":
            args = ["--port", str(self.verifier_port)] + (["--model", self.model] if self.model else [])
            service, port = "specmesh.v1.Verifier", self.verifier_port
        else:
            args = ["--port", str(self.port), "--draft-addrs", f"localhost:{self.draft_port}",
                    "--verifier-addrs", f"localhost:{self.verifier_port}", "--redis-url", self.redis_url,
                    *(["--model", self.model] if self.model else []), *self.orchestrator_args]
            service, port = "specmesh.v1.Orchestrator", self.port
        process = self._spawn(tier, args)
        self._pending = getattr(self, "_pending", []) + [(f"localhost:{port}", service, process, tier)]

    def wait(self) -> None:
        for address, service, process, tier in self._pending:
            wait_serving(address, service, process, self.startup_timeout_s, f"{tier} service")
            log.info("%s SERVING at %s (pid %d)", tier, address, process.pid)
        self._pending = []

    def start(self) -> "Cluster":
        try:
            if not self.redis_url:
                self.redis = EmbeddedRedis().start()
                self.redis_url = self.redis.url
                log.info("embedded redis-server at %s", self.redis_url)
            self.draft_port = self.draft_port or free_port()
            self.verifier_port = self.verifier_port or free_port()
            self.start_tier("verifier")
            self.start_tier("draft")
            self.wait()
            self.start_tier("orchestrator")
            self.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def stop_tier(self, tier: str, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        process = self.processes.pop(tier, None)
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(sig)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop(self) -> dict[str, int | None]:
        """SIGTERM the orchestrator first (it drains streams), then the model tiers."""
        codes = {tier: self.stop_tier(tier) for tier in ("orchestrator", "draft", "verifier")}
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        return codes

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
