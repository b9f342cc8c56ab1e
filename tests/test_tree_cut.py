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
    even = [1.0 + 0.015 * k for k in range(9)]                 # 1.5% a token, as on session 29's Zen 4
    assert tree_min_confidence(even, 5) == pytest.approx(TOKENS_PER_STEP * 0.015)
    avx2 = [1.0, 1.05, 1.10, 1.17, 1.24, 1.30]                 # session 22's AVX2 EPYC: ~6% a token
    assert tree_min_confidence(avx2, 5) == pytest.approx(2 * (1 * .05 + 2 * .1 + 3 * .17 + 4 * .24 + 5 * .3) / 55,
                                                         abs=1e-3)
    assert tree_min_confidence(avx2, 8) == tree_min_confidence(avx2, 5)   # past the table: as far as measured
    jump = [1.0, 1.0, 1.0, 1.0, 1.0, 1.08, 1.19, 1.23, 1.26]  # flat to 4, then dearer (oneDNN's blocking)
    assert tree_min_confidence(jump, 4) == 0.0 < tree_min_confidence(jump, 5) < tree_min_confidence(jump, 8)
    scale = [2.0 * c for c in avx2]                             # a table need not start at exactly 1
    assert tree_min_confidence(scale, 5) == tree_min_confidence(avx2, 5)
    assert tree_min_confidence([1.0, 1.0, 0.99, 1.0], 3) == 0.0   # a GPU: every node is worth it
    assert tree_min_confidence([1.0, 3.0], 1) == MAX_CUT          # a wild measurement still drafts
    assert tree_min_confidence([], 5) == tree_min_confidence([1.0], 5) == tree_min_confidence(avx2, 0) == 0.0


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
    """On a fake clock where a Verify of k draft tokens takes 1 + 0.1 k, the table is exactly that: neither
    the warm-up round nor calls slowed by other work count. The measuring session is gone afterwards."""
    engine = TargetEngine(load_model(str(tiny_models["target"])), VerifierConfig())
    clock, calls = [0.0], []
    verify = engine.verify_batch

    def timed(batch):
        [call] = batch
        calls.append(len(call.proposals))
        result = verify(batch)
        slow = len(calls) <= 4 or len(calls) in (6, 7)       # the warm-up round, and 2 calls of the next one
        clock[0] += 1.0 + 0.1 * len(call.proposals) + (5.0 if slow else 0.0)
        return result

    engine.verify_batch = timed
    cost = measure_verify_cost(engine, max_k=3, rounds=2, clock=lambda: clock[0])
    assert cost == pytest.approx([1.0, 1.1, 1.2, 1.3])
    assert calls == [0, 1, 2, 3] * 3
    clock[0], calls[:] = 0.0, []                               # a round slowed by other work: the fastest counts
    cost = measure_verify_cost(engine, max_k=3, rounds=2, clock=lambda: clock[0])
    assert cost == pytest.approx([1.0, 1.1, 1.2, 1.3])
    assert engine.sessions.get(SESSION) is None and len(engine.sessions) == 0
