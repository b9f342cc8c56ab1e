"""Cross-session batching in the verifier: same logits as one session at a time,
caches that keep working afterwards, and identical greedy output under load."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specmesh.client import Client
from specmesh.kv import KVSession
from specmesh.models import load_model
from verifier_service.batching import batched_forward


@pytest.fixture(scope="module", params=["stock", "packed", "batch-invariant"])
def target(tiny_models, request):
    """The tiny target with torch's linear layers, pre-packed ones, and the verifier's default:
    pre-packed and batch-invariant (where batching must not change a single bit)."""
    from specmesh.fast_linear import apply_kernels

    loaded = load_model(str(tiny_models["target"]))
    invariant = request.param == "batch-invariant"
    apply_kernels(loaded.model, "packed" if invariant else request.param, batch_invariant=invariant)
    loaded.invariant = invariant
    return loaded


def _session(model, tokens, name):
    s = KVSession(name, model)
    s.sync(0, tokens)
    return s


def test_batched_forward_matches_one_at_a_time(target):
    model = target.model
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
    extras = [[3, 4, 5], [], [7]]
    solo = [_session(model, p, f"solo{i}") for i, p in enumerate(prompts)]
    batch = [_session(model, p, f"batch{i}") for i, p in enumerate(prompts)]
    for s in solo + batch:
        s.forward()                                  # warm caches of different lengths
    expected = [s.forward(e) for s, e in zip(solo, extras)]
    got = batched_forward(model, batch, extras)
    for e, g in zip(expected, got):
        assert e.shape == g.shape
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        assert torch.equal(g, e) or not target.invariant
    # The caches handed back keep working: a second step, with a rollback, agrees too.
    for s in solo + batch:
        s.sync(len(s.tokens) - 1, [9])
    expected = [s.forward([1, 2]) for s in solo]
    got = batched_forward(model, batch, [[1, 2]] * 3)
    for e, g, s_solo, s_batch in zip(expected, got, solo, batch):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        assert torch.equal(g, e) or not target.invariant
        assert s_solo.tokens == s_batch.tokens and s_solo.cached_len == s_batch.cached_len


def test_concurrent_sessions_get_the_same_greedy_output(tiny_cluster):
    prompts = ["hello world, hello", "the cat sat on the mat", "abc abc abc", "one two three one two"] * 2
    with Client(tiny_cluster.address) as client:
        sequential = [client.generate(p, max_new_tokens=32, k=3, drafter="model").token_ids for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            concurrent = list(pool.map(
                lambda p: client.generate(p, max_new_tokens=32, k=3, drafter="model").token_ids, prompts))
    assert concurrent == sequential


def test_batch_sizes_are_exported(tiny_models, redis_url, tmp_path):
    """Under concurrent load the verifier reports forward passes shared by several sessions."""
    import urllib.request

    from specmesh_cli.launcher import Cluster
    from specmesh_cli.ports import free_port

    prompts = ["hello world", "the cat sat", "abc abc", "one two three", "x y z", "tea for two"]
    with Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                 redis_url=redis_url, log_dir=tmp_path, metrics=True) as cluster:
        with Client(cluster.address) as client, ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: client.generate(p, max_new_tokens=48, k=2), prompts))
        text = urllib.request.urlopen(cluster.metrics_url("verifier"), timeout=10).read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("specmesh_verify_batch_size_")}
    assert values["specmesh_verify_batch_size_count"] > 0
    # More Verify calls than forward passes: some passes served several sessions.
    assert values["specmesh_verify_batch_size_sum"] > values["specmesh_verify_batch_size_count"]


def test_fresh_and_warm_sessions_batch_together(target):
    """A session rebuilding after a cache miss (no cache yet) can share a pass with warm ones."""
    model = target.model
    warm_solo, warm_batch = _session(model, [5, 6, 7], "w1"), _session(model, [5, 6, 7], "w2")
    warm_solo.forward()
    warm_batch.forward()
    fresh_solo, fresh_batch = _session(model, [9, 8, 7, 6], "f1"), _session(model, [9, 8, 7, 6], "f2")
    expected = [fresh_solo.forward([1]), warm_solo.forward([2, 3])]
    got = batched_forward(model, [fresh_batch, warm_batch], [[1], [2, 3]])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_one_session_twice_in_a_batch_runs_in_order(target):
    """Two queued calls for one session must not share a pass over its one cache."""
    from specmesh.config import VerifierConfig
    from specmesh.proposal import DraftProposal
    from specmesh.sampling import SamplingParams
    from verifier_service.engine import TargetEngine, VerifyCall

    def calls(engine):
        engine.prefill("s", [5, 6, 7, 8])
        p = DraftProposal.point_mass
        return [VerifyCall("s", 4, [], [p(3)], SamplingParams(), 1),
                VerifyCall("s", 5, [4], [p(2), p(1)], SamplingParams(), 1)]

    one_by_one = TargetEngine(target, VerifierConfig())
    sequential = [one_by_one.verify_batch([c])[0] for c in calls(one_by_one)]
    together = TargetEngine(target, VerifierConfig())
    batched = together.verify_batch(calls(together))
    assert [r.cached_len for r in batched] == [r.cached_len for r in sequential]
    assert [r.scores for r in batched] == [r.scores for r in sequential]
    session = together.sessions.get("s")
    assert session.cached_len == len(session.tokens) == 8
