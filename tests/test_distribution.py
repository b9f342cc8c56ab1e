"""Statistical test: the distributed speculative loop samples exactly from the target.

Toy target and draft "models" are Markov tables over V = 8 tokens (next-token logits
depend on the previous token). A small speculative loop built only from the library
functions (draft_token with top-n truncation, score_draft, accept) generates GEN = 3
tokens after a 1-token prompt with k = 2, over many seeds; the empirical joint
distribution of the 3 tokens is compared with the exact target distribution
P[prompt, a] * P[a, b] * P[b, c] by a chi-square test (rare cells pooled).

The test of the test: deliberately wrong rules must be rejected (p < 0.001), so the
check demonstrably has power. Everything is seeded, so results are deterministic.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specmesh.sampling import SamplingParams, Stream, process_logits, sample, uniform
from specmesh.speculative import Acceptance, Scores, accept, draft_token, score_draft

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

V, K, N_TOP, PROMPT, GEN = 8, 2, 4, 3, 3
N_SEEDS = 10_000
ALPHA = 1e-3

_tg = torch.Generator().manual_seed(20230301)
TARGET_LOGITS = 1.5 * torch.randn(V, V, generator=_tg)                                  # [V, V]
_dg = torch.Generator().manual_seed(20221130)
# Correlated with the target (so acceptances, rejections and bonuses all occur) but different.
DRAFT_LOGITS = 0.6 * TARGET_LOGITS + 1.2 * torch.randn(V, V, generator=_dg)            # [V, V]
NGRAM = [(5 * t + 3) % V for t in range(V)]   # a model-free point-mass drafter: prev -> next


def _draft_model(Q):
    """Draft via draft_token on the processed draft table Q [V, V]."""
    def draft(ctx, seed, pos):
        return draft_token(Q[ctx], N_TOP, seed, pos)
    return draft


def _draft_ngram(ctx, seed, pos):
    x = NGRAM[ctx]
    return x, torch.tensor([x]), torch.tensor([1.0])


def _generate(seed, P, drafter, score=score_draft, acc=accept, stats=None):
    """One seeded session: returns the first GEN generated tokens."""
    seq = [PROMPT]
    while len(seq) < 1 + GEN:
        # Absolute position of the first drafted token. After a rejection at position j the
        # next round re-drafts positions > j with the same (seed, position) uniforms; that is
        # still exact because a round's committed outcome only depends on draws at positions
        # <= its last committed one -- and this test checks it.
        start = len(seq)
        toks, q_ids, q_probs, q_x = [], [], [], []
        ctx = seq[-1]
        for j in range(K):
            x, ids, qp = drafter(ctx, seed, start + j)
            toks.append(x)
            q_ids.append(ids)
            q_probs.append(qp)
            q_x.append(float(qp[(ids == x).nonzero()[0, 0]]))
            ctx = x
        rows = P[[seq[-1]] + toks]                                                       # [k+1, V]
        res = acc(toks, q_x, score(rows, toks, q_ids, q_probs, seed, start), seed, start)
        if stats is not None:
            stats[res.accepted] += 1
        seq += res.tokens
    return tuple(seq[1:1 + GEN])


def _chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit; cells with expected < 5 are pooled into one cell."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    if (counts[expected == 0] > 0).any():
        return 0.0                                 # a zero-probability outcome was produced
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:                                # pooled cell still too small: merge into smallest
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        i = exp.argmin()
        obs[i] += counts[~big].sum()
        exp[i] += expected[~big].sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _run(params: SamplingParams, make_drafter=_draft_model, n=N_SEEDS, **kw):
    """Generate n seeded sessions; returns (chi-square p-value, histogram of accepted counts)."""
    P = process_logits(TARGET_LOGITS, params)                                            # [V, V]
    Q = process_logits(DRAFT_LOGITS, params)                                             # [V, V]
    drafter = make_drafter(Q)
    counts = torch.zeros(V, V, V)                                                        # [V, V, V]
    stats = [0] * (K + 1)
    for seed in range(n):
        counts[_generate(seed, P, drafter, stats=stats, **kw)] += 1
    Pd = P.double()
    exact = Pd[PROMPT][:, None, None] * Pd[:, :, None] * Pd[None, :, :]                 # [V, V, V]
    assert abs(exact.sum().item() - 1) < 1e-6
    return _chi2_pvalue(counts, n * exact), stats


def test_chi2_helper():
    # df = 1, stat = 3.8415 -> p = 0.05 (two cells, expected 50/50, observed 59.8/40.2)
    assert abs(_chi2_pvalue(torch.tensor([59.8, 40.2]), torch.tensor([50.0, 50.0])) - 0.05) < 1e-3
    assert _chi2_pvalue(torch.tensor([50.0, 50.0]), torch.tensor([50.0, 50.0])) == 1.0
    assert _chi2_pvalue(torch.tensor([1.0, 99.0]), torch.tensor([0.0, 100.0])) == 0.0


CONFIGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1_topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_matches_target(name):
    p, stats = _run(CONFIGS[name])
    print(f"{name}: p={p:.4g} accepted-count histogram={stats}")
    # every path was exercised: rejection at the first draft, mid-draft, and all accepted
    assert all(s > 50 for s in stats), stats
    assert p > ALPHA


def test_point_mass_draft_matches_target():
    p, stats = _run(SamplingParams(temperature=1.0), make_drafter=lambda Q: _draft_ngram)
    print(f"ngram: p={p:.4g} accepted-count histogram={stats}")
    assert all(s > 50 for s in stats), stats
    assert p > ALPHA


def test_greedy_is_target_argmax_chain():
    P = process_logits(TARGET_LOGITS, SamplingParams())
    Q = process_logits(DRAFT_LOGITS, SamplingParams())
    chain, t = [], PROMPT
    for _ in range(GEN):
        t = int(TARGET_LOGITS[t].argmax())
        chain.append(t)
    for drafter in (_draft_model(Q), _draft_ngram):
        for seed in range(50):
            assert list(_generate(seed, P, drafter)) == chain


# ---- the test of the test: wrong rules must be caught ----------------------------------

def _score_recovered_from_p(rows, toks, q_ids, q_probs, seed, start):
    s = score_draft(rows, toks, q_ids, q_probs, seed, start)
    rec = [sample(rows[i], uniform(seed, start + i, Stream.TARGET)) for i in range(len(toks))]
    return dataclasses.replace(s, recovered_tokens=rec)


def _accept_q_over_p(toks, q_x, scores: Scores, seed, start) -> Acceptance:
    for i, (q, p) in enumerate(zip(q_x, scores.target_probs)):
        if not uniform(seed, start + i, Stream.ACCEPT) < min(1.0, q / p):
            return Acceptance(i, [*toks[:i], scores.recovered_tokens[i]], False)
    return Acceptance(len(toks), [*toks, scores.bonus_token], True)


def _accept_with_draft_stream(toks, q_x, scores: Scores, seed, start) -> Acceptance:
    """Bug: reuses the DRAFT uniform for the accept test (correlated draws)."""
    for i, (q, p) in enumerate(zip(q_x, scores.target_probs)):
        if not uniform(seed, start + i, Stream.DRAFT) < p / q:
            return Acceptance(i, [*toks[:i], scores.recovered_tokens[i]], False)
    return Acceptance(len(toks), [*toks, scores.bonus_token], True)


def _untruncated_model_drafter(Q):
    """Bug: samples from the full q but reports the top-n truncated q."""
    def draft(ctx, seed, pos):
        _, ids, qp = draft_token(Q[ctx], N_TOP, seed, pos)
        x = sample(Q[ctx], uniform(seed, pos, Stream.DRAFT))
        if x not in ids.tolist():
            ids, qp = torch.cat([ids, torch.tensor([x])]), torch.cat([qp, Q[ctx][x:x + 1]])
        return x, ids, qp
    return draft


@pytest.mark.parametrize("bug", ["recovered_from_p", "accept_q_over_p", "draft_stream_reused",
                                 "untruncated_draft"])
def test_wrong_rule_is_detected(bug):
    params = SamplingParams(temperature=1.0)
    if bug == "recovered_from_p":
        p, _ = _run(params, score=_score_recovered_from_p)
    elif bug == "accept_q_over_p":
        p, _ = _run(params, acc=_accept_q_over_p)
    elif bug == "draft_stream_reused":
        p, _ = _run(params, acc=_accept_with_draft_stream)
    else:
        p, _ = _run(params, make_drafter=_untruncated_model_drafter)
    print(f"{bug}: p={p:.4g}")
    assert p < ALPHA
