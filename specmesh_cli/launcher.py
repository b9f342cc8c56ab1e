"""Bring up the three tiers (and the HTTP gateway) as separate processes on this machine (`specmesh up`).

Each tier is `specmesh serve <tier>` in its own process, talking gRPC over
loopback sockets exactly as it would across machines. Draft and verifier start
first and load their models in parallel; the orchestrator starts once both
report SERVING, then the gateway (with `http_port`) once /health says 200.
Tests use the same class.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.tls import ChannelTLS, channel as tls_channel
from specmesh_cli.children import child_env
from specmesh_cli.ports import free_port
from specmesh_cli.redis_server import EmbeddedRedis

log = logging.getLogger("specmesh.launcher")

def wait_serving(address: str, service: str, process: subprocess.Popen | None, timeout_s: float,
                 describe: str = "", tls: ChannelTLS | None = None) -> None:
    """Poll grpc.health.v1 until `service` is SERVING; fail fast if the process dies."""
    deadline = time.monotonic() + timeout_s
    last_note = time.monotonic()
    with tls_channel(address, tls) as channel:
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


def wait_http_ok(url: str, process: subprocess.Popen | None, timeout_s: float, describe: str) -> None:
    """Poll an HTTP health URL until it answers 200; fail fast if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{describe} exited with code {process.returncode} before serving"
                               + (f"; see {process.log_path}" if getattr(process, "log_path", None) else ""))
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{describe} at {url} not healthy after {timeout_s:.0f} s")


def verifier_threads(replicas: int = 1) -> int:
    """A verifier's torch threads where the tiers share this machine: every core, split between its replicas.

    The verifier's forward is nearly all of a step, and within a stream the tiers take turns (the draft
    proposes, then the verifier checks), so one verifier gets every core. On the 2-core build machine,
    the verifier on 2 threads (the draft on 1) against every tier on 1 took a lone stream from 11.1 to
    12.3 tokens/s target-only and from 15.7 to 17.9 with the default drafter, with the same outputs bit
    for bit; under 4 concurrent streams 2 threads held up too (docs/benchmarks.md, "Torch threads per
    tier"). Replicas split the cores: two of 2 threads each on 2 cores gave 22.1 tokens/s against 24.4
    with 1 each."""
    return max(1, (os.cpu_count() or 1) // max(1, replicas))


def _thread_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_thread_arguments(p) -> None:
    """--draft-torch-threads and --verifier-torch-threads, for the commands that start a Cluster."""
    p.add_argument("--draft-torch-threads", type=_thread_count, default=None,
                   help="torch threads of each draft replica (default: 1)")
    p.add_argument("--verifier-torch-threads", type=_thread_count, default=None,
                   help="torch threads of each verifier replica (default: the cores split between them)")


def shared_machine_defaults(tier: str, env: dict[str, str], verifier_replicas: int = 1) -> dict[str, str]:
    """Settings for a tier that shares this machine with the others, where `env` leaves them unset."""
    defaults: dict[str, str] = {}
    if tier == "verifier" and "SPECMESH_TORCH_THREADS" not in env:
        defaults["SPECMESH_TORCH_THREADS"] = str(verifier_threads(verifier_replicas))
        # A prompt gets every core even with replicas: the draft idles then, waiting for its features.
        defaults["SPECMESH_PREFILL_THREADS"] = str(os.cpu_count() or 1)
    return defaults


@dataclass
class Cluster:
    model: str | None = None
    draft_model: str | None = None
    eagle_model: str | None = None       # the `eagle` drafter's folder (specmesh.eagle); None: not served
    port: int = 50051
    redis_url: str | None = None
    draft_replicas: int = 1
    verifier_replicas: int = 1
    # Torch threads per tier: each replica of the tier runs on this many, whatever SPECMESH_TORCH_THREADS
    # says (every tier reads that one). None: the draft's own default (1) and verifier_threads() here.
    draft_torch_threads: int | None = None
    verifier_torch_threads: int | None = None
    # Several orchestrators share Redis: any of them can resume another's session.
    orchestrator_replicas: int = 1
    log_dir: Path | None = None          # None: children log to this terminal
    extra_env: dict[str, str] = field(default_factory=dict)
    orchestrator_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    draft_ports: list[int] = field(default_factory=list)
    verifier_ports: list[int] = field(default_factory=list)
    redis: EmbeddedRedis | None = None
    _pending: list = field(default_factory=list)
    _restart_at: dict[str, float] = field(default_factory=dict)
    _backoff: dict[str, float] = field(default_factory=dict)
    # The interface every service binds; None: theirs ("[::]", all interfaces, as in a pod).
    host: str | None = None
    _more_orchestrator_ports: list[int] = field(default_factory=list)
    # metrics=True gives every process a free Prometheus port: metrics_ports["orchestrator" | "draft-0" | ...].
    metrics: bool = False
    metrics_ports: dict[str, int] = field(default_factory=dict)
    # The OpenAI-compatible HTTP gateway's port; None: no gateway.
    http_port: int | None = None
    gateway_args: list[str] = field(default_factory=list)
    # TLS everywhere: every gRPC port serves this certificate, the draft and verifier require client
    # certificates from this CA (mutual TLS), the orchestrator and gateway verify their upstreams with
    # it, and an embedded Redis speaks TLS too. The certificate must name localhost and serve as both
    # server and client certificate.
    tls: ChannelTLS | None = None

    def __post_init__(self):
        for name in ("draft_torch_threads", "verifier_torch_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset: the tier's default), got {value}")

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    @property
    def orchestrator_ports(self) -> list[int]:
        return [self.port] + self._more_orchestrator_ports

    @property
    def target(self) -> str:
        """A gRPC target naming every orchestrator: a channel fails over from one to the next."""
        return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in self.orchestrator_ports)

    @property
    def http_url(self) -> str:
        return f"http://localhost:{self.http_port}"

    def served_model(self) -> str:
        """The model id the gateway serves (what OpenAI clients put in `model`)."""
        with urllib.request.urlopen(f"{self.http_url}/v1/models", timeout=10) as reply:
            return json.load(reply)["data"][0]["id"]

    @property
    def draft_port(self) -> int:
        return self.draft_ports[0]

    @property
    def verifier_port(self) -> int:
        return self.verifier_ports[0]

    def _tls_env(self, tier: str) -> dict[str, str]:
        if self.tls is None:
            return {}
        env = {"SPECMESH_TLS_CA_FILE": self.tls.ca_file}   # orchestrator -> replicas, gateway -> orchestrator
        if tier != "gateway":   # the gateway stays plain HTTP on loopback
            env |= {"SPECMESH_TLS_CERT_FILE": self.tls.cert_file, "SPECMESH_TLS_KEY_FILE": self.tls.key_file}
        if tier in ("draft", "verifier"):
            env["SPECMESH_TLS_CLIENT_CA_FILE"] = self.tls.ca_file
        return env

    def _spawn(self, name: str, tier: str, args: list[str]) -> subprocess.Popen:
        env = {**os.environ, **self._tls_env(tier), **self.extra_env, **child_env(signal.SIGTERM)}
        threads = {"draft": self.draft_torch_threads, "verifier": self.verifier_torch_threads}.get(tier)
        if threads is not None:
            env["SPECMESH_TORCH_THREADS"] = str(threads)
        env = {**shared_machine_defaults(tier, env, self.verifier_replicas), **env}
        out: IO | None = None
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{name}.log"
            out = open(log_path, "ab")
        if self.host:
            args = [*args, "--host", self.host]
        process = subprocess.Popen([sys.executable, "-m", "specmesh_cli.cli", "serve", tier, *args], env=env,
                                   stdout=out, stderr=subprocess.STDOUT if out else None)
        process.log_path = log_path
        self.processes[name] = process
        return process

    def supervise(self) -> list[str]:
        """Restart every child that died (as Kubernetes would), with a doubling back-off for one
        that keeps dying; the orchestrators route around a replica meanwhile. Returns what was
        restarted. Call it from the thread that started the cluster (see children.die_with_parent)."""
        restarted, now = [], time.monotonic()
        for name, process in list(self.processes.items()):
            if process.poll() is None or now < self._restart_at.get(name, 0.0):
                continue
            delay = min(30.0, 2 * self._backoff.get(name, 0.5)) if now - self._restart_at.get(name, -1e9) < 60 else 1.0
            self._backoff[name], self._restart_at[name] = delay, now + delay
            log.warning("%s exited with code %s; restarting it (next restart no sooner than %.0f s)",
                        name, process.returncode, delay)
            self.start_tier(name)
            restarted.append(name)
        if self.redis is not None and self.redis.process.poll() is not None:
            log.warning("redis-server exited with code %s; restarting it on port %d",
                        self.redis.process.returncode, self.redis.port)
            self.redis = self.redis.again().start()
            restarted.append("redis")
        self._pending = []   # restarted children report SERVING on their own; nothing waits for them here
        return restarted

    def start_tier(self, name: str) -> None:
        """(Re)start one process: "orchestrator", "gateway", "draft-<i>" or "verifier-<i>"."""
        tier, _, index = name.partition("-")
        if tier == "gateway":   # metrics are on its HTTP port (/metrics)
            args = ["--http-port", str(self.http_port),
                    "--orchestrator-addr", self.address, *self.gateway_args]
            self._pending.append((f"{self.http_url}/health", "http", self._spawn(name, tier, args), name))
            return
        if tier == "draft":
            port = self.draft_ports[int(index)]
            args = ["--port", str(port)] + (["--draft-model", self.draft_model] if self.draft_model else []) \
                + (["--eagle-model", self.eagle_model] if self.eagle_model else [])
            service = "specmesh.v1.Draft"
        elif tier == "verifier":
            port = self.verifier_ports[int(index)]
            args = ["--port", str(port)] + (["--model", self.model] if self.model else [])
            service = "specmesh.v1.Verifier"
        else:
            port = self.orchestrator_ports[int(index or 0)]
            args = ["--port", str(port),
                    "--draft-addrs", ",".join(f"localhost:{p}" for p in self.draft_ports),
                    "--verifier-addrs", ",".join(f"localhost:{p}" for p in self.verifier_ports),
                    "--redis-url", self.redis_url,
                    *(["--model", self.model] if self.model else []), *self.orchestrator_args]
            service = "specmesh.v1.Orchestrator"
        if self.metrics:
            args += ["--metrics-port", str(self.metrics_ports.setdefault(name, free_port()))]
        self._pending.append((f"localhost:{port}", service, self._spawn(name, tier, args), name))

    def metrics_url(self, name: str) -> str:
        """The scrape URL of a process ("orchestrator", "draft-0", ...; a bare tier means its replica 0)."""
        name = name if name in self.metrics_ports else f"{name}-0"
        return f"http://localhost:{self.metrics_ports[name]}/metrics"

    def wait(self) -> None:
        for address, service, process, name in self._pending:
            if service == "http":
                wait_http_ok(address, process, self.startup_timeout_s, f"{name} service")
            else:
                wait_serving(address, service, process, self.startup_timeout_s, f"{name} service", self.tls)
            log.info("%s SERVING at %s (pid %d)", name, address, process.pid)
        self._pending = []

    def start(self) -> "Cluster":
        try:
            if not self.redis_url:
                self.redis = EmbeddedRedis(tls=self.tls).start()
                self.redis_url = self.redis.url
                log.info("embedded redis-server at %s", self.redis_url)
            self.draft_ports = self.draft_ports or [free_port() for _ in range(self.draft_replicas)]
            self.verifier_ports = self.verifier_ports or [free_port() for _ in range(self.verifier_replicas)]
            for i in range(len(self.verifier_ports)):
                self.start_tier(f"verifier-{i}")
            for i in range(len(self.draft_ports)):
                self.start_tier(f"draft-{i}")
            # The orchestrators start beside the model tiers, as pods of a release do: each waits for its
            # replicas to serve (orchestrator.server.when_serving), so its imports and tokenizer load
            # overlap the models' loading instead of following it. A tier that fails is still reported
            # first: wait() checks the processes in the order they started.
            self._more_orchestrator_ports = [free_port() for _ in range(self.orchestrator_replicas - 1)]
            self.start_tier("orchestrator")
            for i in range(1, self.orchestrator_replicas):
                self.start_tier(f"orchestrator-{i}")
            self.wait()
            if self.http_port:
                self.start_tier("gateway")
                self.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def stop_tier(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(sig)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop(self) -> dict[str, int | None]:
        """SIGTERM the gateway and the orchestrators first (they drain their streams), then the model tiers."""
        names = sorted(self.processes, key=lambda n: (n != "gateway", not n.startswith("orchestrator"), n))
        codes = {name: self.stop_tier(name) for name in names}
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        return codes

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
