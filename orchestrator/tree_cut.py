"""How sure the draft must be of a tree node before the verifier spends a token on it.

A node whose whole path the draft gives the chance c adds about c committed tokens to a step, and
costs the verifier one more token in its forward pass. A step commits about TOKENS_PER_STEP tokens
for the cost of a 1-token verify (more or less: the draft's passes and the services cost too, and a
cut also saves draft passes, which pulls the other way). So a node pays when

    c / TOKENS_PER_STEP  >  (what one more verified token costs, as a share of a 1-token verify)

The share is what the verifier measured at start-up (VerifierInfo.verify_cost, at the request's k).
Measured ahead of this rule: on session 22's AVX2 EPYC a token cost 6.3% of a step, and the best
fixed cut held-out was 0.1 (this rule, on its in-process table: 0.12); on session 29's Zen 4 EPYC it costs 1.5%, and the old
fixed 0.1 gave away 6% of the tokens per step for 3% of the step (this rule: 0.03); on a GPU it is
about 0, and so is the cut (docs/distill.md, "A tree cut by what a verified token costs").

The cut is chosen once per session and kept in its record: the tree the draft grows decides the
draws of a sampled step, so a session resumed elsewhere, or moved to another verifier replica, must
keep drafting with the same cut to keep its sampled tokens.
"""
from __future__ import annotations

import statistics
from typing import Sequence

TOKENS_PER_STEP = 2.0   # what the shipped EAGLE draft commits per step on Spec-Bench: 1.97-2.08
MAX_CUT = 0.5           # a noisy measurement never stops a tree from drafting altogether


def tree_min_confidence(verify_cost: Sequence[float], k: int) -> float:
    """The cut for a session drafting k tokens a step, from verify_cost[1..k] (a Verify of j draft tokens /
    one of none; past the measured k, as far as measured). A draft token's cost is the least-squares slope
    of the cost over j through the 1-token step, which reads every size up to k rather than one noisy
    figure. 0 when not measured."""
    sizes = range(1, min(k, len(verify_cost) - 1) + 1)
    if not sizes:
        return 0.0
    per_token = sum(j * (verify_cost[j] / verify_cost[0] - 1) for j in sizes) / sum(j * j for j in sizes)
    return round(min(MAX_CUT, max(0.0, TOKENS_PER_STEP * per_token)), 3)


def pooled(verify_costs: Sequence[Sequence[float]]) -> list[float]:
    """One verify-cost table for a verifier pool: the median of its replicas' at each k, as far as every
    replica measured (an old replica measures nothing: then nothing)."""
    if not verify_costs or any(len(c) == 0 for c in verify_costs):
        return []
    return [statistics.median(c[k] for c in verify_costs) for k in range(min(len(c) for c in verify_costs))]
