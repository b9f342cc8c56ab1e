"""Redis faults: a blip costs latency, never a stream; an outage is UNAVAILABLE
(naming no internal address) with health NOT_SERVING, and everything recovers
by itself when Redis returns, without restarting any service."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from specmesh.client import Client
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from specmesh_cli.redis_server import EmbeddedRedis
from tests.conftest import SERVING, health_status

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

PROMPTS = ["alpha beta gamma", "one two three four", "hello there, hello", "the lazy dog sleeps"]
REQUEST = dict(max_new_tokens=240, k=3, drafter="model", temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """A cluster on a Redis of its own that the tests may kill and restart on the same port."""
    redis = EmbeddedRedis().start()
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis.url, log_dir=tmp_path_factory.mktemp("logs-redis-faults"),
                      startup_timeout_s=900, orchestrator_args=["--redis-retry-s", "5"])
    cluster.start()
    state = {"redis": redis, "cluster": cluster}
    try:
        yield state
    finally:
        cluster.stop()
        state["redis"].stop()


def _restart_redis(state, down_s: float) -> None:
    port = state["redis"].port
    state["redis"].process.kill()              # SIGKILL: no goodbye, and its data is gone
    state["redis"].process.wait()
    time.sleep(down_s)
    state["redis"] = EmbeddedRedis(port=port).start()


def test_streams_in_flight_ride_out_a_redis_restart(stack):
    address = stack["cluster"].address
    with Client(address) as client:
        reference = {p: client.generate(p, **REQUEST).token_ids for p in PROMPTS}
    results: dict[str, list[int]] = {}

    def run(prompt):
        with Client(address) as client:
            results[prompt] = client.generate(prompt, **REQUEST).token_ids

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    time.sleep(0.3)
    _restart_redis(stack, down_s=1.0)
    for t in threads:
        t.join(120)
    assert results == reference


def test_redis_down_is_unavailable_and_not_serving_then_recovers(stack):
    cluster = stack["cluster"]
    port = stack["redis"].port
    stack["redis"].process.kill()
    stack["redis"].process.wait()
    try:
        deadline = time.monotonic() + 10
        while health_status(cluster.address, "specmesh.v1.Orchestrator") == SERVING and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health_status(cluster.address, "specmesh.v1.Orchestrator") != SERVING
        with Client(cluster.address) as client:
            with pytest.raises(grpc.RpcError) as error:
                client.generate("while redis is down", max_new_tokens=8)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in error.value.details() and str(port) not in error.value.details()
        assert "127.0.0.1" not in error.value.details()
    finally:
        stack["redis"] = EmbeddedRedis(port=port).start()
    deadline = time.monotonic() + 10
    while health_status(cluster.address, "specmesh.v1.Orchestrator") != SERVING and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health_status(cluster.address, "specmesh.v1.Orchestrator") == SERVING
    with Client(cluster.address) as client:
        assert client.generate("redis is back", max_new_tokens=8).finish_reason == "length"
