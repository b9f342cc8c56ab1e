import pytest
import torch

from specmesh.sampling import SamplingParams, Stream, process_logits, uniform
from specmesh.speculative import Acceptance, Scores, accept, draft_token, score_draft

GREEDY = SamplingParams(temperature=0.0)


def _greedy_step(target_logits, draft, seed, start):
    """Run score_draft + accept with greedy (one-hot) p and point-mass q."""
    p = process_logits(target_logits, GREEDY)                                   # [k+1, V]
    k = len(draft)
    scores = score_draft(p, draft, [torch.tensor([x]) for x in draft],
                         [torch.tensor([1.0])] * k, seed, start)
    return accept(draft, [1.0] * k, scores, seed, start)


def test_greedy_is_longest_matching_prefix_then_target_argmax():
    g = torch.Generator().manual_seed(0)
    V, k = 6, 4
    n_partial = 0
    for trial in range(300):
        logits = torch.randn(k + 1, V, generator=g)
        logits[:, 2] = logits[:, 3]            # include ties: argmax must pick the lowest id
        argmax = logits.argmax(-1).tolist()    # torch: first maximal index
        # draft matches the target argmax at each position with prob 0.7
        draft = [a if torch.rand(1, generator=g).item() < 0.7 else (a + 1) % V for a in argmax[:k]]
        m = 0
        while m < k and draft[m] == argmax[m]:
            m += 1
        expected = draft[:m] + [argmax[m]]
        for seed in (trial, trial + 1000):
            res = _greedy_step(logits, draft, seed, start=17 + trial)
            assert res.accepted == m
            assert res.tokens == expected
            assert res.bonus == (m == k)
        n_partial += 0 < m < k
    assert n_partial > 20   # the test exercised mid-draft rejections


def test_all_accepted_gives_bonus():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.2, 0.3, 0.5]])     # [k+1, V], k = 2
    draft = [1, 2]
    bonuses = set()
    for seed in range(50):
        scores = score_draft(p, draft, [torch.tensor([1, 0]), torch.tensor([2])],
                             [torch.tensor([0.6, 0.4]), torch.tensor([1.0])], seed, 40)
        res = accept(draft, [0.6, 1.0], scores, seed, 40)   # p/q >= 1: always accepted
        assert res == Acceptance(accepted=2, tokens=[1, 2, scores.bonus_token], bonus=True)
        bonuses.add(scores.bonus_token)
    assert bonuses == {0, 1, 2}   # the bonus is a draw from p_{k+1}


def test_first_rejection_commits_recovered_and_stops():
    scores = Scores(target_probs=[1.0, 0.0, 1.0], recovered_tokens=[7, 8, 9], bonus_token=5)
    for seed in range(20):
        res = accept([1, 2, 3], [1.0, 1.0, 1.0], scores, seed, 0)
        assert res == Acceptance(accepted=1, tokens=[1, 8], bonus=False)
    # k = 0: only the bonus
    assert accept([], [], Scores([], [], 4), 1, 9) == Acceptance(0, [4], True)


def test_point_mass_q_accepts_with_prob_p():
    """n-gram drafter: q = point mass, so x is accepted iff u < p(x)."""
    p = torch.tensor([[0.1, 0.3, 0.6], [0.2, 0.3, 0.5]])                       # [k+1, V], k = 1
    n, acc, rec = 4000, 0, {0: 0, 1: 0, 2: 0}
    for seed in range(n):
        scores = score_draft(p, [1], [torch.tensor([1])], [torch.tensor([1.0])], seed, 3)
        assert scores.target_probs == pytest.approx([0.3])
        res = accept([1], [1.0], scores, seed, 3)
        assert res.accepted == (uniform(seed, 3, Stream.ACCEPT) < 0.3)
        if res.accepted:
            acc += 1
        else:
            rec[res.tokens[0]] += 1
    assert abs(acc / n - 0.3) < 0.03
    # recovered ~ p with x removed: [0.1, 0, 0.6] / 0.7
    assert rec[1] == 0
    assert abs(rec[0] / (n - acc) - 1 / 7) < 0.03
    # p(x) = 0 -> always rejected; p(x) = 1 -> always accepted
    zero = Scores([0.0], [2], 0)
    one = Scores([1.0], [2], 0)
    for seed in range(100):
        assert accept([1], [1.0], zero, seed, 3).accepted == 0
        assert accept([1], [1.0], one, seed, 3).accepted == 1


def test_accept_rule_is_u_less_than_p_over_q():
    # q(x) = 0.5, p(x) = 0.2 -> accept iff u < 0.4
    scores = Scores([0.2], [0], 1)
    for seed in range(500):
        u = uniform(seed, 11, Stream.ACCEPT)
        assert accept([3], [0.5], scores, seed, 11).accepted == (u < 0.4)


def test_draft_token_and_accept_agree_on_positions():
    """Drafted token i at start+i uses the DRAFT stream; acceptance uses ACCEPT at start+i."""
    q = torch.tensor([0.5, 0.5, 0.0])
    tok, ids, qp = draft_token(q, 2, seed=3, position=8)
    assert tok in (0, 1)
    p = torch.tensor([[0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
    scores = score_draft(p, [tok], [ids], [qp], 3, 8)
    res = accept([tok], [float(qp[ids.tolist().index(tok)])], scores, 3, 8)
    assert res.accepted == (uniform(3, 8, Stream.ACCEPT) < 0.5)
    assert res.tokens == ([tok, 0] if res.accepted else [2])   # residual is one-hot at 2


def test_mismatched_lengths_and_zero_q_raise():
    with pytest.raises(ValueError):
        accept([1, 2], [1.0], Scores([1.0], [0], 0), 0, 0)
    with pytest.raises(ValueError):
        accept([1], [0.0], Scores([1.0], [0], 0), 0, 0)
