"""TLS on every gRPC port, mutual TLS between the tiers, certificates that rotate
without a restart, and Redis over TLS with a password.

Certificates come from `trustme` (a throwaway CA per test run): a real CA, real
keys, the real handshakes, in memory and on local files only.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.replicas import ReplicaPool
from specmesh import tls
from specmesh.client import Client
from specmesh.server import ServiceRuntime
from specmesh.tls import ChannelTLS, ServerTLS
from specmesh.v1 import cache_pb2, draft_pb2_grpc, verifier_pb2_grpc
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from specmesh_cli.redis_server import EmbeddedRedis
from tests.conftest import status_of
from tools.dev_pki import HOSTS, write_pki

REDIS_PASSWORD = "redis-pw-3e8a91c7d0"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> ChannelTLS:
    return write_pki(tmp_path_factory.mktemp("pki"), trustme.CA())


@pytest.fixture(scope="module")
def sealed(tiny_models, pki, tmp_path_factory):
    """The whole stack with TLS on every port, mutual TLS to the draft and verifier, and a Redis
    that speaks only TLS and wants a password."""
    root = tmp_path_factory.mktemp("sealed")
    with EmbeddedRedis(tls=pki, password=REDIS_PASSWORD) as redis:
        cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                          redis_url=redis.url, log_dir=root / "logs", startup_timeout_s=900, tls=pki,
                          http_port=free_port())
        with cluster:
            yield cluster, root


def test_the_public_api_speaks_tls_only(sealed, pki):
    cluster, _ = sealed
    with Client(cluster.address, tls=ChannelTLS(pki.ca_file)) as client:
        speculative = client.generate("hello there", max_new_tokens=12, k=3, drafter="model")
        plain = client.generate("hello there", max_new_tokens=12, k=0)
    assert speculative.finish_reason == "length" and len(speculative.token_ids) == 12
    assert speculative.token_ids == plain.token_ids   # lossless over TLS, through Redis over TLS
    with Client(cluster.address, resume_attempts=0) as plaintext:
        assert status_of(lambda: plaintext.generate("hi", max_new_tokens=2)) == grpc.StatusCode.UNAVAILABLE


def test_the_gateway_reaches_the_orchestrator_over_tls(sealed):
    cluster, _ = sealed
    body = {"model": cluster.served_model(), "prompt": "hello there", "max_tokens": 6, "temperature": 0}
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6


def test_a_server_signed_by_another_ca_is_not_trusted(sealed, tmp_path):
    cluster, _ = sealed
    elsewhere = write_pki(tmp_path, trustme.CA())
    with Client(cluster.address, tls=ChannelTLS(elsewhere.ca_file), resume_attempts=0) as client:
        assert status_of(lambda: client.generate("hi", max_new_tokens=2)) == grpc.StatusCode.UNAVAILABLE


def test_internal_ports_admit_only_the_internal_certificate(sealed, pki, tmp_path):
    cluster, _ = sealed
    stranger = write_pki(tmp_path, trustme.CA())   # a valid certificate, from a CA the tiers do not trust
    callers = {
        "no client certificate": (grpc.StatusCode.UNAVAILABLE, ChannelTLS(pki.ca_file)),
        "a stranger's certificate": (grpc.StatusCode.UNAVAILABLE,
                                     ChannelTLS(pki.ca_file, stranger.cert_file, stranger.key_file)),
        "the internal certificate": (grpc.StatusCode.OK, pki),
    }
    for port, stub_cls in ((cluster.verifier_port, verifier_pb2_grpc.VerifierStub),
                           (cluster.draft_port, draft_pb2_grpc.DraftStub)):
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            assert status_of(lambda: stub_cls(channel).Info(cache_pb2.InfoRequest(), timeout=5)) \
                == grpc.StatusCode.UNAVAILABLE, "plaintext"
        for who, (expected, creds) in callers.items():
            with grpc.secure_channel(f"localhost:{port}", creds.credentials()) as channel:
                code = status_of(lambda: stub_cls(channel).Info(cache_pb2.InfoRequest(), timeout=5))
            assert code == expected, f"{who} on port {port}"


def test_no_secret_reaches_a_log(sealed, pki):
    cluster, root = sealed
    key_body = Path(pki.key_file).read_text().splitlines()[1]
    for log in (root / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        assert REDIS_PASSWORD not in text, log.name
        assert key_body not in text, log.name
    orchestrator_log = (root / "logs" / "orchestrator.log").read_text()
    assert "(TLS, specmesh.v1.Orchestrator)" in orchestrator_log   # the public port: TLS, no client certificates
    assert "(mutual TLS, specmesh.v1.Verifier)" in (root / "logs" / "verifier-0.log").read_text()
    assert "(mutual TLS, specmesh.v1.Draft)" in (root / "logs" / "draft-0.log").read_text()


async def _health(address: str, creds: grpc.ChannelCredentials) -> int:
    async with grpc.aio.secure_channel(address, creds) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def test_a_rotated_certificate_is_served_without_a_restart(tmp_path):
    old, new = trustme.CA(), trustme.CA()
    files = write_pki(tmp_path / "mounted", old)
    runtime = ServiceRuntime(["test.Service"], 0, host="127.0.0.1",
                             tls=ServerTLS(files.cert_file, files.key_file))
    port = await runtime.start(lambda server: None)
    await runtime.set_serving(True)
    try:
        address = f"localhost:{port}"
        assert await _health(address, ChannelTLS(files.ca_file).credentials()) == health_pb2.HealthCheckResponse.SERVING
        # A half-done rotation (a key that does not match the certificate) is ignored: the old pair serves on.
        fresh = new.issue_cert(*HOSTS)
        fresh.private_key_pem.write_to_path(files.key_file)
        assert await _health(address, grpc.ssl_channel_credentials(old.cert_pem.bytes())) \
            == health_pb2.HealthCheckResponse.SERVING
        fresh.cert_chain_pems[0].write_to_path(files.cert_file)   # the pair is whole again: the new one serves
        assert await _health(address, grpc.ssl_channel_credentials(new.cert_pem.bytes())) \
            == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(address, grpc.ssl_channel_credentials(old.cert_pem.bytes()))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await runtime.server.stop(0)


async def test_replica_channels_reconnect_when_their_files_rotate(tmp_path):
    """The orchestrator's side: a replica moves to a new CA; the pool follows its CA file."""
    old, new = trustme.CA(), trustme.CA()
    server_files = write_pki(tmp_path / "server", old)
    client_files = write_pki(tmp_path / "client", old)
    runtime = ServiceRuntime(["test.Service"], 0, host="127.0.0.1",
                             tls=ServerTLS(server_files.cert_file, server_files.key_file))
    port = await runtime.start(lambda server: None)
    await runtime.set_serving(True)
    pool = ReplicaPool.connect("test", [f"localhost:{port}"], health_pb2_grpc.HealthStub, retry_s=1,
                               tls=ChannelTLS(client_files.ca_file))
    follower = asyncio.ensure_future(tls.follow_rotation(ChannelTLS(client_files.ca_file),
                                                         lambda: pool.reconnect(1.0), every_s=0.05))
    try:
        check = health_pb2.HealthCheckRequest()
        assert (await pool.replicas[0].stub.Check(check, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
        # Both ends rotate to the new CA; the server's next handshake uses its new pair.
        cert = new.issue_cert(*HOSTS)
        cert.private_key_pem.write_to_path(server_files.key_file)
        cert.cert_chain_pems[0].write_to_path(server_files.cert_file)
        new.cert_pem.write_to_path(client_files.ca_file)
        first = pool.replicas[0].channel
        deadline = time.monotonic() + 10
        while pool.replicas[0].channel is first and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert pool.replicas[0].channel is not first, "the pool did not reconnect"
        assert (await pool.replicas[0].stub.Check(check, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        follower.cancel()
        await pool.close()
        await runtime.server.stop(0)


def test_half_a_tls_configuration_is_refused_by_name(tmp_path, pki):
    run = subprocess.run([sys.executable, "-m", "specmesh_cli.cli", "serve", "draft", "--port", "0",
                          "--tls-cert-file", pki.cert_file], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "tls_key_file" in run.stderr, run.stderr
    mismatched = write_pki(tmp_path, trustme.CA())
    run = subprocess.run([sys.executable, "-m", "specmesh_cli.cli", "serve", "draft", "--port", "0",
                          "--tls-cert-file", pki.cert_file, "--tls-key-file", mismatched.key_file],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "do not make a pair" in run.stderr, run.stderr
