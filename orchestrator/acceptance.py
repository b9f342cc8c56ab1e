"""The speculative-sampling acceptance rule (Leviathan et al. 2023, arXiv 2211.17192,
Algorithm 1; Chen et al. 2023, arXiv 2302.01318, Algorithm 2).

For i = 1..k accept draft token x_i iff u(seed, pos_i, ACCEPT) < p_i(x_i) / q_i(x_i)
(same as u < min(1, p/q) since u < 1). At the first rejection commit the recovered
token and stop; if all k pass commit all k plus the bonus token. Greedy needs no
special case: p and q are one-hot, so p/q is 0 or 1 and the rule keeps the longest
prefix matching the target argmax, then the target's argmax.

Glossary: *draft tokens* x_1..x_k proposed by the draft; *accepted* the prefix that
passed; *recovered* the token drawn from norm(max(0, p_i - q_i)) on rejection;
*bonus* the token drawn from p_{k+1} when all k pass; *committed* accepted tokens
plus exactly one recovered or bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specmesh.sampling import Scores, Stream, uniform


@dataclass(frozen=True)
class Acceptance:
    accepted: int             # number of draft tokens accepted (0..k)
    tokens: list[int]         # the committed tokens: accepted draft tokens + one recovered or bonus token
    bonus: bool               # True when all k passed


def accept(draft_tokens: Sequence[int], draft_probs: Sequence[float], scores: Scores,
           seed: int, start_position: int) -> Acceptance:
    """draft_probs[i] = q_i(x_i), the truncated-q probability x_i was sampled with;
    draft token i sits at absolute position start_position + i."""
    k = len(draft_tokens)
    if not (len(draft_probs) == len(scores.target_probs) == len(scores.recovered_tokens) == k):
        raise ValueError("draft_tokens, draft_probs and scores must all have length k")
    for i in range(k):
        q = draft_probs[i]
        if not q > 0:
            raise ValueError(f"draft token {i} has q(x) = {q}; a sampled token needs q(x) > 0")
        if not uniform(seed, start_position + i, Stream.ACCEPT) < scores.target_probs[i] / q:
            return Acceptance(i, [*draft_tokens[:i], scores.recovered_tokens[i]], False)
    return Acceptance(k, [*draft_tokens, scores.bonus_token], True)
