"""The production decode loop samples exactly from the target, on real (tiny) models.

tests/test_distribution.py proves the math on toy tables. This runs the code a
request really runs: orchestrator.decode.Decoder with its acceptance rule, a
real Redis for the session, and the draft and verifier servicers and engines
with tiny random Hugging Face models over a 10-token vocabulary (KV caches,
cropping, truncated proposals and all). Only the sockets are left out, so that
thousands of sessions fit in a test; test_reproducibility and
test_greedy_equality cover the same code across real processes.

The empirical distribution of the first two generated tokens over thousands of
seeded sessions is compared with the exact target distribution by a
chi-square test, at temperature 1 and with top-k and with top-p. The test of
the test: the same check with a deliberately wrong rule (every draft token
accepted) must fail.
"""
from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

import orchestrator.decode as decode
from draft_service.engine import DraftEngine
from draft_service.servicer import DraftServicer
from specmesh.speculative import Acceptance
from orchestrator.decode import Decoder
from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.requests import GenerationRequest
from orchestrator.sessions import SessionStore
from specmesh.config import DraftConfig, VerifierConfig
from specmesh.models import load_model
from specmesh.sampling import SamplingParams, process_logits
from specmesh.engine_host import EngineHost
from tests.tiny_models import build_tiny_model
from tests.test_distribution import _chi2_pvalue
from verifier_service.batching import VerifyBatcher
from verifier_service.engine import TargetEngine
from verifier_service.servicer import VerifierServicer

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

DRAWS = 2500
ALPHA = 1e-3
K = 3
CONCURRENT = 8    # sessions in flight at once, as under load: the verifier batches their steps


class InProcessStub:
    """Calls a servicer's methods directly: the wire is the only thing skipped."""

    def __init__(self, servicer):
        self._servicer = servicer

    def __getattr__(self, name):
        method = getattr(self._servicer, name)

        async def call(request, timeout=None):
            return await method(request, None)

        return call


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    target = load_model(str(build_tiny_model(root / "target", seed=11, vocab="tiny", init_std=0.15)))
    draft = build_tiny_model(root / "draft", seed=12, vocab="tiny", init_std=0.15)
    return target, draft


def exact_two_token_distribution(target, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """P(x1) P(x2 | x1) from the target, with EOS ending the sequence after x1."""
    eos = set(target.info.eos_token_ids)
    with torch.inference_mode():
        p1 = process_logits(target.model(input_ids=torch.tensor([prompt])).logits[0, -1], params)
        dist = {}
        for x1 in range(len(p1)):
            if p1[x1] == 0:
                continue
            if x1 in eos:
                dist[(x1,)] = float(p1[x1])
                continue
            p2 = process_logits(target.model(input_ids=torch.tensor([prompt + [x1]])).logits[0, -1], params)
            for x2 in range(len(p2)):
                if p2[x2] > 0:
                    dist[(x1, x2)] = float(p1[x1] * p2[x2])
    return dist


async def sample_sessions(target, draft_path, redis_url, prompt, params, draws) -> dict[tuple, int]:
    draft_host, verifier_host = EngineHost("draft"), EngineHost("target")
    draft_config = DraftConfig(draft_model=str(draft_path), max_sessions=4 * CONCURRENT)
    draft_host.engine = DraftEngine.from_config(draft_config)
    verifier_host.engine = TargetEngine(target, VerifierConfig(max_sessions=4 * CONCURRENT))
    drafts = ReplicaPool("draft", [Replica("in-process-draft", None, InProcessStub(DraftServicer(draft_host)))])
    verifier = VerifierServicer(verifier_host, VerifyBatcher(verifier_host, max_batch=CONCURRENT))
    verifiers = ReplicaPool("verifier", [Replica("in-process-verifier", None, InProcessStub(verifier))])
    sessions = SessionStore.from_url(redis_url, ttl_s=60)
    decoder = Decoder(sessions, drafts, verifiers, target.tokenizer, set(target.info.eos_token_ids),
                      draft_top_n=4, rpc_timeout_s=30)
    gate = asyncio.Semaphore(CONCURRENT)

    async def session(seed: int) -> tuple:
        async with gate:
            request = GenerationRequest(session_id=uuid.uuid4().hex, prompt_ids=prompt, max_new_tokens=2,
                                        params=params, seed=seed, stop=(), k=K, drafter="model")
            return tuple([t async for chunk in decoder.run(request) for t in chunk.token_ids])

    counts: dict[tuple, int] = {}
    try:
        for tokens in await asyncio.gather(*(session(seed) for seed in range(draws))):
            counts[tokens] = counts.get(tokens, 0) + 1
    finally:
        await sessions.client.aclose()
    return counts


def p_value(target, draft_path, redis_url, params, draws=DRAWS) -> float:
    prompt = target.tokenizer("abc").input_ids
    exact = exact_two_token_distribution(target, prompt, params)
    counts = asyncio.run(sample_sessions(target, draft_path, redis_url, prompt, params, draws))
    cells = sorted(set(exact) | set(counts))
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    expected = torch.tensor([exact.get(c, 0.0) for c in cells], dtype=torch.float64) * draws
    return _chi2_pvalue(observed, expected)


PARAMS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.8, top_k 4": SamplingParams(temperature=0.8, top_k=4),
    "temperature 1, top_p 0.7": SamplingParams(temperature=1.0, top_p=0.7),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_decode_loop_samples_the_target_distribution(pair, redis_url, name):
    target, draft = pair
    p = p_value(target, draft, redis_url, PARAMS[name])
    assert p > ALPHA, f"{name}: chi-square p = {p:.2e}"


def test_the_check_catches_a_wrong_rule(pair, redis_url, monkeypatch):
    """Accepting every draft token yields the draft's distribution, not the target's."""
    def accept_everything(draft_tokens, draft_probs, scores, seed, start_position):
        return Acceptance(len(draft_tokens), list(draft_tokens) + [scores.bonus_token], True)

    monkeypatch.setattr(decode, "accept", accept_everything)
    target, draft = pair
    p = p_value(target, draft, redis_url, PARAMS["temperature 1"], draws=1000)
    assert p < ALPHA, f"a wrong acceptance rule passed the check (p = {p:.3f})"
