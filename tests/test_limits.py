"""Limits give clear statuses: RESOURCE_EXHAUSTED past the active-session limit,
INVALID_ARGUMENT past the configured prompt and total lengths, UNAVAILABLE when
a tier is down, and the orchestrator recovers when it returns."""
from __future__ import annotations

import time

import grpc
import pytest

from specmesh.client import Client, build_request
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tests.conftest import SERVING, health_status

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)


@pytest.fixture(scope="module")
def limited(tiny_models, redis_url, tmp_path_factory):
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=tmp_path_factory.mktemp("logs-limited"),
                      orchestrator_args=["--max-active-sessions", "1", "--replica-retry-s", "2",
                                         "--max-prompt-tokens", "64", "--max-total-tokens", "420"])
    with cluster:
        yield cluster


def test_beyond_the_active_session_limit_is_resource_exhausted(limited):
    with Client(limited.address) as client:
        stream = client.stream(build_request("hello hello", max_new_tokens=400, k=1))
        next(stream)
        try:
            with pytest.raises(grpc.RpcError) as info:
                client.generate("hi", max_new_tokens=4)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit is 1" in info.value.details()
        finally:
            stream.cancel()
        time.sleep(0.5)   # the cancelled stream releases its slot
        assert len(client.generate("hi", max_new_tokens=4).token_ids) == 4


def test_a_tier_down_is_unavailable_and_recovers(limited):
    with Client(limited.address) as client:
        before = client.generate("the cat", max_new_tokens=12, k=2).token_ids
        limited.stop_tier("verifier-0")
        try:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                client.generate("the cat", max_new_tokens=12, k=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 30
            assert health_status(limited.address, "specmesh.v1.Orchestrator") == SERVING
        finally:
            limited.start_tier("verifier-0")
            limited.wait()
        assert client.generate("the cat", max_new_tokens=12, k=2).token_ids == before


def test_configured_prompt_and_total_lengths_are_invalid_argument(limited):
    with Client(limited.address) as client:
        assert len(client.generate([5] * 64, max_new_tokens=2).token_ids) == 2
        with pytest.raises(grpc.RpcError) as info:
            client.generate([5] * 65, max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "prompt: 65 tokens exceed max_prompt_tokens = 64"
        with pytest.raises(grpc.RpcError) as info:
            client.generate([5] * 10, max_new_tokens=411)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("max_new_tokens") and "max_total_tokens = 420" in info.value.details()


def test_kv_cache_bytes_are_bounded_by_evicting_the_least_recently_used(tiny_models):
    from specmesh.config import VerifierConfig
    from specmesh.kv import cache_nbytes
    from specmesh.models import load_model
    from verifier_service.engine import TargetEngine

    target = load_model(str(tiny_models["target"]))
    probe = TargetEngine(target, VerifierConfig())
    probe.prefill("probe", list(range(5, 45)))
    one = cache_nbytes(probe.sessions.get("probe").cache)
    engine = TargetEngine(target, VerifierConfig(max_cache_bytes=int(2.5 * one)))
    for name in ("a", "b", "c"):
        engine.prefill(name, list(range(5, 45)))
    assert engine.sessions.get("a") is None and engine.sessions.get("b") and engine.sessions.get("c")
    assert sum(cache_nbytes(s.cache) for s in engine.sessions.snapshot()) <= 2.5 * one
    assert engine.sessions.evictions == 1   # its next call is a cache miss, rebuilt (next test)


def test_output_is_unchanged_when_caches_keep_being_evicted(tiny_models, redis_url, tmp_path):
    """Byte limits so small that every session evicts the others: more re-prefills, same tokens."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["first of many", "second one here", "third prompt", "fourth and last"]
    limited = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=tmp_path, startup_timeout_s=900,
                      extra_env={"SPECMESH_MAX_CACHE_BYTES": "20000"})
    with limited:
        with Client(limited.address) as client, ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.generate(p, max_new_tokens=40, k=3, drafter="model",
                                                          temperature=0.9, seed=3).token_ids, prompts))
        with Client(limited.address) as client:
            alone = [client.generate(p, max_new_tokens=40, k=3, drafter="model", temperature=0.9, seed=3).token_ids
                     for p in prompts]
    assert got == alone
