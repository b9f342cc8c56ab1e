"""A seeded session gives the same tokens on fresh service processes; seeds matter."""
from __future__ import annotations

import pytest

from specmesh.client import Client
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

SAMPLED = dict(max_new_tokens=32, temperature=1.0, top_p=0.95, k=3, drafter="model")
PROMPTS = ["hello world", "the cat sat on the mat"]


def _run_fresh(tiny_models, redis_url, log_dir, seeds):
    with Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                 redis_url=redis_url, log_dir=log_dir, startup_timeout_s=600) as cluster:
        with Client(cluster.address) as client:
            return {(p, s): client.generate(p, seed=s, **SAMPLED).token_ids for p in PROMPTS for s in seeds}


@pytest.fixture(scope="module")
def two_runs(tiny_models, redis_url, tmp_path_factory):
    seeds = [7, 8, 1234567]
    first = _run_fresh(tiny_models, redis_url, tmp_path_factory.mktemp("repro-a"), seeds)
    second = _run_fresh(tiny_models, redis_url, tmp_path_factory.mktemp("repro-b"), seeds)
    return first, second


def test_same_seed_same_tokens_across_fresh_processes(two_runs):
    first, second = two_runs
    assert first == second


def test_different_seeds_differ(two_runs):
    first, _ = two_runs
    for prompt in PROMPTS:
        assert len({tuple(first[(prompt, s)]) for s in (7, 8, 1234567)}) == 3


def test_seed_reported_and_reusable(tiny_client):
    a = tiny_client.generate("hello", max_new_tokens=16, temperature=1.0, k=2)
    b = tiny_client.generate("hello", max_new_tokens=16, temperature=1.0, k=2, seed=a.seed)
    assert a.seed != 0 and a.token_ids == b.token_ids
