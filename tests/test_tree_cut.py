"""A draft tree's cut from what the verifier measured a verified token to cost."""
from __future__ import annotations

import pytest

from orchestrator.decode import _params_record, _request_from_record
from orchestrator.requests import GenerationRequest
from orchestrator.sessions import Handle, SessionRecord
from orchestrator.tree_cut import MAX_CUT, TOKENS_PER_STEP, pooled, tree_min_confidence
from specmesh.config import VerifierConfig
from specmesh.models import load_model
from specmesh.sampling import SamplingParams
from verifier_service.engine import TargetEngine
from verifier_service.verify_cost import SESSION, measure_verify_cost


def test_the_cut_is_what_a_verified_token_costs_times_the_tokens_a_step_commits():
    zen4 = [1.0, 1.01, 1.02, 1.04, 1.06, 1.075, 1.19, 1.23, 1.26]     # session 29's CPU (flat to 5, then a jump)
    assert tree_min_confidence(zen4, 5) == pytest.approx(TOKENS_PER_STEP * 0.075 / 5)
    assert tree_min_confidence(zen4, 8) == pytest.approx(TOKENS_PER_STEP * 0.26 / 8)   # the jump counts
    avx2 = [1.0, 1.05, 1.10, 1.17, 1.24, 1.30]                         # session 22's: 6% a token
    assert tree_min_confidence(avx2, 5) == pytest.approx(0.12)
    assert tree_min_confidence(avx2, 8) == tree_min_confidence(avx2, 5)   # past the table: its last slope
    assert tree_min_confidence([1.0, 1.0, 0.99, 1.0], 3) == 0.0           # a GPU: every node is worth it
    assert tree_min_confidence([1.0, 3.0], 1) == MAX_CUT                  # a wild measurement still drafts
    assert tree_min_confidence([], 5) == tree_min_confidence(avx2, 0) == 0.0


def test_a_pool_shares_the_median_of_its_replicas_costs():
    assert pooled([[1.0, 1.1, 1.2], [1.0, 1.3, 1.4, 1.5], [1.0, 1.2, 1.3]]) == [1.0, 1.2, 1.3]
    assert pooled([[1.0, 1.1], []]) == []          # a replica that measures nothing: no table, no cut sent
    assert pooled([]) == []


def test_a_session_record_keeps_its_cut_and_an_older_record_has_none():
    request = GenerationRequest("s", [1, 2, 3], 10, SamplingParams(0.7, 0, 1.0), 5, (), 4, "eagle", 0.031)
    record = SessionRecord(session_id="s", tokens=[1, 2, 3], prompt_len=3, params=_params_record(request), seed=5,
                           step=0, status="active", draft_handle=Handle(), verifier_handle=Handle(), ttl_s=60)
    assert _request_from_record(record) == request
    del record.params["tree_min_confidence"]
    assert _request_from_record(record).tree_min_confidence is None


def test_the_verifier_measures_each_k_against_none_in_a_session_of_its_own(tiny_models):
    """On a fake clock where a Verify of k draft tokens takes 1 + 0.1 k, the table is exactly that, the
    warm-up round is not counted, and the measuring session is gone afterwards."""
    engine = TargetEngine(load_model(str(tiny_models["target"])), VerifierConfig())
    clock, calls = [0.0], []
    verify = engine.verify_batch

    def timed(batch):
        [call] = batch
        calls.append(len(call.proposals))
        result = verify(batch)
        clock[0] += 1.0 + 0.1 * len(call.proposals) + (5.0 if len(calls) <= 4 else 0.0)   # a slow first round
        return result

    engine.verify_batch = timed
    cost = measure_verify_cost(engine, max_k=3, rounds=2, clock=lambda: clock[0])
    assert cost == pytest.approx([1.0, 1.1, 1.2, 1.3])
    assert calls == [0, 1, 2, 3] * 3
    assert engine.sessions.get(SESSION) is None and len(engine.sessions) == 0
