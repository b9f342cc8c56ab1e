"""The verifier's threads. prefill_threads: a prompt is read on more torch threads than a step runs on,
and nothing it computes changes: its features, and the sampled scores of the steps after it, keep their
bits. And the threads `specmesh up` gives a verifier that shares the machine with the other tiers."""
from __future__ import annotations

import pytest
import torch

from specmesh import kv
from specmesh.config import VerifierConfig
from specmesh.fast_linear import apply_kernels
from specmesh.models import load_model
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from verifier_service.engine import TargetEngine, VerifyCall

PROMPT = [(7 * i + 3) % 97 for i in range(150)]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_FORWARD = kv.KVSession.forward


def _spied_engine(tiny_models, prefill_threads: int, monkeypatch) -> tuple[TargetEngine, list[int], int]:
    """(a verifier engine on the tiny target, the thread counts its forward passes see, the vocabulary size)."""
    loaded = load_model(str(tiny_models["target"]))
    apply_kernels(loaded.model, "packed", batch_invariant=True)
    engine = TargetEngine(loaded, VerifierConfig(prefill_threads=prefill_threads))
    seen: list[int] = []

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return _FORWARD(self, *args, **kwargs)

    monkeypatch.setattr(kv.KVSession, "forward", spy)
    return engine, seen, loaded.info.vocab_size


def _run(tiny_models, prefill_threads: int, monkeypatch) -> tuple[torch.Tensor, list, list[int]]:
    """(the prompt's features, the scores of three sampled steps after it, the thread counts forward saw)."""
    engine, seen, vocab = _spied_engine(tiny_models, prefill_threads, monkeypatch)
    prompt = [t % vocab for t in PROMPT]
    _, features = engine.prefill("s", prompt, features=True)
    drafts = [DraftProposal.point_mass(t % vocab) for t in (5, 8, 13)]
    scores, n = [], len(prompt)
    for step in range(3):
        verified = engine.verify_batch([VerifyCall("s", n, [11 + step], drafts, SamplingParams(temperature=0.8),
                                                   seed=3)])[0]
        scores.append(verified.scores)
        n += 1
    return features, scores, seen


def test_a_prompt_read_on_two_threads_gives_the_bits_of_one_and_steps_keep_their_threads(
        tiny_models, monkeypatch, one_thread):
    features, scores, seen = _run(tiny_models, 2, monkeypatch)
    assert seen == [2, 1, 1, 1]                     # the prefill on 2 threads, each step on the 1 it had
    assert torch.get_num_threads() == 1
    same_features, same_scores, seen_one = _run(tiny_models, 0, monkeypatch)
    assert seen_one == [1, 1, 1, 1]                 # 0: the torch threads the verifier runs with
    assert torch.equal(features, same_features)
    assert scores == same_scores


def test_a_verify_that_rebuilds_a_lost_cache_reads_on_the_prefill_threads(tiny_models, monkeypatch, one_thread):
    """A replica that never saw the session (start = 0: failover, eviction) reads the whole prompt inside
    the Verify: on the prefill's threads, with the scores of a replica that read it on one."""
    results = {}
    for threads in (2, 0):
        engine, seen, vocab = _spied_engine(tiny_models, threads, monkeypatch)
        prompt = [t % vocab for t in PROMPT]
        drafts = [DraftProposal.point_mass(t % vocab) for t in (5, 8, 13)]
        params = SamplingParams(temperature=0.8)
        rebuilt = engine.verify_batch([VerifyCall("s", 0, prompt, drafts, params, seed=3)])[0]
        step = engine.verify_batch([VerifyCall("s", len(prompt), [11], drafts, params, seed=3)])[0]
        results[threads] = (seen, rebuilt.scores, step.scores)
        assert torch.get_num_threads() == 1
    assert results[2][0] == [2, 1] and results[0][0] == [1, 1]   # the rebuild on 2, the next step on 1
    assert results[2][1:] == results[0][1:]


def test_the_threads_come_back_when_reading_the_prompt_fails(tiny_models, monkeypatch, one_thread):
    loaded = load_model(str(tiny_models["target"]))
    engine = TargetEngine(loaded, VerifierConfig(prefill_threads=2))

    def abandoned(self, *args, **kwargs):          # the caller went away mid-prompt (engine_host.Abandoned)
        assert torch.get_num_threads() == 2
        raise RuntimeError("stopped mid-prompt")

    monkeypatch.setattr(kv.KVSession, "forward", abandoned)
    with pytest.raises(RuntimeError, match="mid-prompt"):
        engine.prefill("s", [1, 2, 3])
    assert torch.get_num_threads() == 1


def test_specmesh_up_gives_the_verifier_every_core_split_between_its_replicas(monkeypatch):
    """Within a stream the tiers take turns, so one verifier steps on every core; replicas split them;
    a prompt is read on every core either way; threads the user set are left alone."""
    from specmesh_cli import bench_peers, launcher

    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 4)
    monkeypatch.delenv("SPECMESH_TORCH_THREADS", raising=False)
    assert launcher.shared_machine_defaults("verifier", {}) == {
        "SPECMESH_TORCH_THREADS": "4", "SPECMESH_PREFILL_THREADS": "4"}
    assert launcher.shared_machine_defaults("verifier", {}, verifier_replicas=2)["SPECMESH_TORCH_THREADS"] == "2"
    assert launcher.shared_machine_defaults("verifier", {}, verifier_replicas=8)["SPECMESH_TORCH_THREADS"] == "1"
    assert launcher.shared_machine_defaults("verifier", {"SPECMESH_TORCH_THREADS": "3"}) == {}
    assert bench_peers.verifier_threads() == 4      # the HF peers get what the bench's one verifier gets
    monkeypatch.setenv("SPECMESH_TORCH_THREADS", "1")
    assert bench_peers.verifier_threads() == 1


def test_each_tier_runs_on_the_threads_given_for_it_whatever_the_environment_says(
        tiny_models, redis_url, tmp_path, monkeypatch):
    """SPECMESH_TORCH_THREADS is read by every tier; --draft-torch-threads and --verifier-torch-threads
    set one tier's, and win over it. Each process says its count once it has set it."""
    import re

    from specmesh_cli.launcher import Cluster
    from specmesh_cli.ports import free_port

    monkeypatch.setenv("SPECMESH_TORCH_THREADS", "3")
    with Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                 redis_url=redis_url, log_dir=tmp_path, host="127.0.0.1", startup_timeout_s=900,
                 draft_torch_threads=2, verifier_torch_threads=1):
        pass
    said = {name: re.findall(r"torch intra-op threads: (\d+)", (tmp_path / f"{name}.log").read_text())
            for name in ("draft-0", "verifier-0", "orchestrator")}
    assert said == {"draft-0": ["2"], "verifier-0": ["1"], "orchestrator": ["3"]}
    with pytest.raises(ValueError, match="draft_torch_threads must be >= 1"):
        Cluster(draft_torch_threads=0)


def test_a_thread_count_below_one_is_refused_by_the_commands(capsys):
    from specmesh_cli.cli import main

    for command in (["bench", "--draft-torch-threads", "0"], ["soak", "--verifier-torch-threads", "-2"]):
        with pytest.raises(SystemExit) as exit_:
            main(command)
        assert exit_.value.code == 2
        assert "must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--draft-torch-threads", "-1"]) == 2     # before any process starts
