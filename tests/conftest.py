"""Shared fixtures: a real Redis, tiny random model pairs, and real service clusters.

Clusters are session-scoped: each starts draft, verifier and orchestrator as
separate processes once and is shared by every test that asks for it.
"""
from __future__ import annotations

import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.client import Client
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import PORT_RANGE_ENV, free_port
from specmesh_cli.redis_server import EmbeddedRedis
from tests.tiny_models import build_tiny_model

# Under pytest-xdist (`-n auto --dist loadfile --no-loadscope-reorder`, pyproject.toml's addopts), a worker
# per core, whole modules to a worker. There the long modules (module-level `pytestmark = pytest.mark.slow`)
# are handed out first, so no worker starts one when the others are nearly done. In one process (`-n 0`) the
# order stays the files' own.
MAX_WORKERS = 4   # each worker starts its own clusters; more than this mostly adds their start-ups
FIRST_TEST_PORT, FIRST_EPHEMERAL_PORT = 20000, 32768   # Linux's default ip_local_port_range starts at 32768


def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def pytest_configure(config) -> None:
    """Each process of the run draws service ports from a range of its own (specmesh_cli.ports), below
    the kernel's ephemeral ports. A port found free is bound only seconds later, by a service still
    importing; two xdist workers drawing from one pool could be handed the same port in that window."""
    if os.environ.get(PORT_RANGE_ENV):
        return   # the caller's choice
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
        return   # xdist's controller starts no service, and its workers would inherit its range
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    span = (FIRST_EPHEMERAL_PORT - FIRST_TEST_PORT) // workers
    low = FIRST_TEST_PORT + index * span
    os.environ[PORT_RANGE_ENV] = f"{low}-{low + span - 1}"


def pytest_collection_modifyitems(items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):   # xdist's workers collect; the controller hands out in this order
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)   # stable: modules stay whole


@pytest.fixture(scope="session")
def redis_url():
    """REDIS_URL when set (an external Redis), else a redis-server started here."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A target and two drafts sharing its character vocabulary: one different
    (rejections happen) and one identical to the target (everything is accepted)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": build_tiny_model(root / "target", seed=1),
        "draft": build_tiny_model(root / "draft", seed=2),
        "other_vocab": build_tiny_model(root / "other", seed=3, vocab="tiny"),
    }


def _cluster(tmp_path_factory, name, redis_url, **kwargs):
    cluster = Cluster(port=free_port(), redis_url=redis_url, log_dir=tmp_path_factory.mktemp(f"logs-{name}"),
                      startup_timeout_s=900, **kwargs)
    return cluster


@pytest.fixture(scope="session")
def tiny_cluster(tmp_path_factory, redis_url, tiny_models):
    """Three processes serving the tiny target, with the tiny draft model and the n-gram drafter."""
    cluster = _cluster(tmp_path_factory, "tiny", redis_url, model=str(tiny_models["target"]),
                       draft_model=str(tiny_models["draft"]))
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory, redis_url):
    """Three processes serving the default SmolLM2-135M-Instruct target with the n-gram drafter."""
    with _cluster(tmp_path_factory, "real", redis_url) as cluster:
        yield cluster


@pytest.fixture
def tiny_client(tiny_cluster):
    with Client(tiny_cluster.address) as client:
        yield client


def health_status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


SERVING = health_pb2.HealthCheckResponse.SERVING


def status_of(call) -> grpc.StatusCode:
    """The status a gRPC call ends with (OK when it returns)."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def stream_through_a_kill(cluster, request, after_tokens: int = 20, chunks: list | None = None) -> list[int]:
    """Stream `request` on a cluster of two or more orchestrators, SIGKILL the one driving it once
    `after_tokens` arrived (the client resumes it on another), start that one again; -> every token
    (and every chunk into `chunks`)."""
    tokens, killed = [], False
    with Client(cluster.target) as client:   # pick_first: the stream goes to the first, which is killed
        for chunk in client.stream(request):
            if chunks is not None:
                chunks.append(chunk)
            assert chunk.offset == len(tokens)
            tokens += chunk.token_ids
            if len(tokens) >= after_tokens and not killed:
                cluster.stop_tier("orchestrator", signal.SIGKILL)
                killed = True
    cluster.start_tier("orchestrator")   # back for the next case
    cluster.wait()
    assert killed
    return tokens
