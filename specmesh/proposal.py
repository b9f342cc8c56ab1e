"""The one plain type that crosses from the draft tier to the verifier tier."""
from __future__ import annotations

from dataclasses import dataclass

import torch


# The most tokens a truncated proposal may carry: keeps a step's messages
# O(k * support), never O(k * vocabulary), whatever a caller asks for.
MAX_PROPOSAL_SUPPORT = 64


@dataclass(frozen=True)
class DraftProposal:
    """One draft token and the truncated proposal q it was sampled from.

    A model-free drafter proposes a point mass: q_ids = [token_id], q_probs = [1.0].
    """

    token_id: int
    q_ids: torch.Tensor     # [n] int64
    q_probs: torch.Tensor   # [n] float32, sums to 1
    parent: int | None = None   # in a draft tree (specmesh.tree): its parent's index, -1 the root; None: a chain

    @classmethod
    def point_mass(cls, token_id: int, parent: int | None = None) -> "DraftProposal":
        return cls(token_id, torch.tensor([token_id], dtype=torch.long), torch.tensor([1.0]), parent)

    @property
    def draft_prob(self) -> float:
        """q(x): the probability the draft sampled its own token with."""
        hit = (self.q_ids == self.token_id).nonzero()
        return float(self.q_probs[hit[0, 0]]) if len(hit) else 0.0
