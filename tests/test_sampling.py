import math

import pytest
import torch

from specmesh.sampling import SamplingParams, Stream, process_logits, sample, sample_rows, truncate_top_n, uniform
from specmesh.speculative import Scores, draft_token, residual, score_draft


# ---- uniform -------------------------------------------------------------------------

def test_uniform_deterministic_and_in_range():
    assert uniform(7, 12, Stream.DRAFT) == uniform(7, 12, Stream.DRAFT)
    # Pinned value: must be identical in every process / replica / version.
    assert uniform(0, 0, Stream.DRAFT) == 0.18436667429957676
    assert uniform(12345, 678, Stream.ACCEPT) == 0.8958275269460726
    for s in range(200):
        for st in Stream:
            u = uniform(s, s * 31 + 5, st)
            assert 0.0 <= u < 1.0
    assert 0.0 <= uniform(-1, 2**70, Stream.TARGET) < 1.0


def test_uniform_differs_across_inputs():
    base = uniform(1, 10, Stream.ACCEPT)
    assert uniform(2, 10, Stream.ACCEPT) != base
    assert uniform(1, 11, Stream.ACCEPT) != base
    assert uniform(1, 10, Stream.DRAFT) != base
    assert uniform(1, 10, Stream.TARGET) != base
    vals = {uniform(s, p, st) for s in range(10) for p in range(10) for st in Stream}
    assert len(vals) == 300


def test_uniform_roughly_uniform():
    us = torch.tensor([uniform(3, p, Stream.ACCEPT) for p in range(10_000)], dtype=torch.float64)
    assert abs(us.mean().item() - 0.5) < 0.01          # sd of mean ~ 0.0029
    assert abs(us.var().item() - 1 / 12) < 0.004       # sd of var ~ 0.0007
    # across seeds at a fixed position too
    us = torch.tensor([uniform(s, 5, Stream.DRAFT) for s in range(10_000)], dtype=torch.float64)
    assert abs(us.mean().item() - 0.5) < 0.01
    hist = torch.histc(us, bins=10, min=0, max=1)
    assert hist.min() > 850 and hist.max() < 1150


# ---- process_logits ------------------------------------------------------------------

def test_greedy_one_hot_ties_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    probs = process_logits(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("temperature", [1e-40, 1.4e-45, 1e-30])
def test_a_tiny_temperature_is_the_greedy_limit_not_nan(temperature):
    """logits / 1e-40 overflows float32 to inf, and softmax of inf - inf is NaN; subtracting the
    max first sends the others to -inf and keeps the max at 0."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 10
    for params in (SamplingParams(temperature), SamplingParams(temperature, top_k=5),
                   SamplingParams(temperature, top_p=0.5)):
        probs = process_logits(logits, params)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs, process_logits(logits, SamplingParams(0.0)))


def test_a_huge_temperature_is_near_uniform():
    probs = process_logits(torch.randn(50) * 10, SamplingParams(3e38))
    assert torch.isfinite(probs).all() and torch.allclose(probs, torch.full((50,), 1 / 50))


def test_temperature_only_is_softmax():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    probs = process_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_top_k_keeps_k():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 50, generator=g)
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=7))
    assert ((probs > 0).sum(-1) == 7).all()
    topk = logits.topk(7, dim=-1).indices
    assert (probs.gather(-1, topk) > 0).all()
    kept = torch.softmax(logits.gather(-1, topk), -1)
    assert torch.allclose(probs.gather(-1, topk), kept, atol=1e-6)
    # ties at the boundary: exactly k kept, lowest ids win
    tied = process_logits(torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]), SamplingParams(1.0, top_k=2))
    assert torch.allclose(tied, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))


def test_top_p_keeps_nucleus():
    probs_in = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs_in.log()
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05 -> cumulative 0.4, 0.7, 0.85 ...
    out = process_logits(logits, SamplingParams(1.0, top_p=0.7))
    assert torch.allclose(out, torch.tensor([0, 0.4, 0.3, 0, 0]) / 0.7, atol=1e-6)
    out = process_logits(logits, SamplingParams(1.0, top_p=0.71))
    assert torch.allclose(out, torch.tensor([0, 0.4, 0.3, 0.15, 0]) / 0.85, atol=1e-6)
    out = process_logits(logits, SamplingParams(1.0, top_p=0.01))   # always at least one
    assert torch.equal(out, torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    # top-k is applied (and renormalised) before top-p: alone, top_p=0.5 keeps {1, 2} (0.4 < 0.5);
    # after top_k=2 the head has 4/7 >= 0.5, so only token 1 stays. Batched rows are independent.
    assert ((process_logits(logits, SamplingParams(1.0, top_p=0.5)) > 0).sum() == 2)
    both = process_logits(torch.stack([logits, logits.flip(0)]), SamplingParams(1.0, top_k=2, top_p=0.5))
    assert torch.equal(both, torch.tensor([[0.0, 1, 0, 0, 0], [0, 0, 0, 1, 0]]))
    both = process_logits(torch.stack([logits, logits.flip(0)]), SamplingParams(1.0, top_k=2, top_p=0.6))
    assert torch.allclose(both[0], torch.tensor([0, 4 / 7, 3 / 7, 0, 0]), atol=1e-6)
    assert torch.allclose(both[1], torch.tensor([0, 0, 3 / 7, 4 / 7, 0]), atol=1e-6)


# ---- sample ---------------------------------------------------------------------------

def test_sample_never_zero_prob():
    p = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.7, 0.0])
    us = [0.0, 1e-12, 0.3 - 1e-12, 0.3, 0.5, 1.0 - 2**-53]
    for u in us:
        assert p[sample(p, u)] > 0
    assert sample(p, 0.0) == 1 and sample(p, 0.29) == 1 and sample(p, 0.31) == 4
    assert sample(p, 1.0 - 2**-53) == 4
    assert sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), 0.999999) == 2
    with pytest.raises(ValueError):
        sample(torch.zeros(3), 0.5)
    with pytest.raises(ValueError):
        sample(torch.ones(2, 2), 0.5)


def test_sample_matches_distribution():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    counts = torch.zeros(4)
    for pos in range(4000):
        counts[sample(p, uniform(9, pos, Stream.TARGET))] += 1
    assert counts[1] == 0
    assert torch.allclose(counts / 4000, p, atol=0.03)


# ---- truncate_top_n / draft_token -----------------------------------------------------

def test_truncate_top_n_renormalises():
    p = torch.tensor([0.1, 0.05, 0.4, 0.0, 0.3, 0.15])
    ids, q = truncate_top_n(p, 3)
    assert ids.dtype == torch.int64 and q.dtype == torch.float32
    assert ids.tolist() == [2, 4, 5]
    assert torch.allclose(q, torch.tensor([0.4, 0.3, 0.15]) / 0.85)
    assert abs(q.sum().item() - 1) < 1e-6
    ids, q = truncate_top_n(torch.tensor([0.0, 1.0, 0.0]), 5)   # zeros dropped, m <= n
    assert ids.tolist() == [1] and q.tolist() == [1.0]


def test_draft_token_samples_truncated_q():
    p = torch.tensor([0.1, 0.05, 0.4, 0.0, 0.3, 0.15])
    seen = set()
    for pos in range(300):
        tok, ids, q = draft_token(p, 2, seed=4, position=pos)
        assert ids.tolist() == [2, 4]
        assert tok in (2, 4)
        assert torch.allclose(q, torch.tensor([0.4, 0.3]) / 0.7)
        assert draft_token(p, 2, seed=4, position=pos)[0] == tok   # deterministic
        assert tok == ids[sample(q, uniform(4, pos, Stream.DRAFT))]
        seen.add(tok)
    assert seen == {2, 4}


# ---- residual --------------------------------------------------------------------------

def test_residual_properties():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q_ids = torch.tensor([1, 3])
    q_probs = torch.tensor([0.5, 0.5])
    r = residual(p, q_ids, q_probs)
    # max(0, p - q) = [0.1, 0, 0.3, 0] -> normalised
    assert torch.allclose(r, torch.tensor([0.25, 0.0, 0.75, 0.0]))
    assert r.dtype == torch.float32 and abs(r.sum().item() - 1) < 1e-6
    # zero where p <= q; never positive where p == 0
    p2 = torch.tensor([0.0, 0.5, 0.5, 0.0])
    r2 = residual(p2, torch.tensor([1]), torch.tensor([1.0]))
    assert torch.equal(r2, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    # fallback to p when p == q on the support
    r3 = residual(p2, torch.tensor([1, 2]), torch.tensor([0.5, 0.5]))
    assert torch.equal(r3, p2)
    # identity: min(p, q) + (1 - sum min(p, q)) * residual == p
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        pp = torch.softmax(torch.randn(10, generator=g), 0)
        ids, qq = truncate_top_n(torch.softmax(torch.randn(10, generator=g) * 2, 0), 4)
        qd = torch.zeros(10).index_put_((ids,), qq)
        m = torch.minimum(pp, qd)
        recon = m + (1 - m.sum()) * residual(pp, ids, qq)
        assert torch.allclose(recon, pp, atol=1e-6)


# ---- score_draft ----------------------------------------------------------------------

def test_score_draft_shapes_and_values():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])  # [k+1, V], k = 2
    s = score_draft(p, [1, 0], [torch.tensor([1]), torch.tensor([0, 2])],
                    [torch.tensor([1.0]), torch.tensor([0.6, 0.4])], seed=5, start_position=10)
    assert isinstance(s, Scores)
    assert s.target_probs == pytest.approx([0.5, 0.2])
    assert s.recovered_tokens[0] == 0                  # residual of row 0 is one-hot at 0
    assert s.recovered_tokens[1] in (1, 2)             # residual [0, .3, .1]
    assert s.bonus_token == 2
    # k = 0: the bonus is plain target sampling at start_position
    s0 = score_draft(p[1:2], [], [], [], seed=5, start_position=10)
    assert s0.target_probs == [] and s0.recovered_tokens == []
    assert s0.bonus_token == sample(p[1], uniform(5, 10, Stream.TARGET))
    with pytest.raises(ValueError):
        score_draft(p, [1], [torch.tensor([1])], [torch.tensor([1.0])], 5, 10)
    assert math.isfinite(s.target_probs[0])


def test_sample_rows_draws_what_sample_draws_row_by_row():
    """The batched draw (distill's data) is the services' one-row draw: the same token for every row and
    uniform, at the ends of [0, 1) too, with zero-probability tokens first, last and between."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 40, generator=gen)
    probs[probs < 0.4] = 0.0
    probs[:, 0], probs[:, -1] = 0.0, 0.0
    probs[0] = 0.0
    probs[0, 7] = 1e-30                                                  # one token, and a tiny one
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[1], u[2] = 0.0, 1.0 - 2.0 ** -53
    rows = sample_rows(probs, u)
    assert rows.tolist() == [sample(probs[r], float(u[r])) for r in range(64)]
    assert bool((probs[torch.arange(64), rows] > 0).all())
