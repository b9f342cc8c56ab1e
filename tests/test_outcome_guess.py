"""tools/outcome_guess.py: outcomes of a draft chain ranked by the draft's own chances."""
from __future__ import annotations

import torch

from tools.outcome_guess import likeliest_outcomes


def test_outcomes_are_ranked_by_the_chain_prefix_times_the_next_token_and_skip_the_chains_own():
    # Chain of 2 draft ids (0 then 1) over a 3-token draft vocabulary.
    probs = [torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.7, 0.2, 0.1])]
    ranked = likeliest_outcomes([0, 1], probs, per_length=3)
    chances = {(j, t): c for c, j, t in ranked}
    # Stopping at length 0 with the chain's own first token is not an outcome (it would be accepted).
    assert (0, 0) not in chances and (1, 1) not in chances
    assert abs(chances[(0, 1)] - 0.3) < 1e-6
    assert abs(chances[(1, 2)] - 0.6 * 0.3) < 1e-6
    assert abs(chances[(2, 0)] - 0.6 * 0.5 * 0.7) < 1e-6       # the whole chain, then the bonus token
    assert [c for c, _, _ in ranked] == sorted((c for c, _, _ in ranked), reverse=True)
    assert ranked[0][1:] == (0, 1) and len(ranked) == 2 + 2 + 3
