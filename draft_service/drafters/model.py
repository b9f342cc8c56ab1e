"""Drafting with a small causal LM that shares the target's vocabulary.

Each draft token is sampled from the draft's distribution after the same
temperature / top-k / top-p processing as the target's, truncated to its
top_n tokens (a truncated q is still a valid proposal: the rule stays exact
and only O(top_n) numbers per position go on the wire).
"""
from __future__ import annotations

from specmesh.config import DraftConfig
from specmesh.fast_linear import apply_kernels
from specmesh.kv import KVSession
from specmesh.models import load_model
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams, process_logits
from specmesh.speculative import draft_token
from draft_service.drafters.base import Drafter, register


@register
class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, loaded):
        self.model = loaded.model
        self.model_name = loaded.info.name
        self.vocab_size = loaded.info.vocab_size
        self.vocab_fingerprint = loaded.info.vocab_fingerprint
        self.max_context = loaded.info.max_context

    @classmethod
    def from_config(cls, config: DraftConfig) -> "ModelDrafter | None":
        if not config.draft_model:
            return None
        loaded = load_model(config.draft_model, device=config.device)
        apply_kernels(loaded.model, config.linear_kernels)
        return cls(loaded)

    def new_state(self, session_id: str) -> KVSession:
        return KVSession(session_id, self.model)

    def propose(self, state: KVSession, k: int, params: SamplingParams, seed: int,
                top_n: int) -> list[DraftProposal]:
        proposals: list[DraftProposal] = []
        logits = state.forward(last_only=True)          # [1, V]: predicts position len(state.tokens)
        for i in range(k):
            probs = process_logits(logits[-1], params)  # [V]
            token, q_ids, q_probs = draft_token(probs, top_n, seed, len(state.tokens))
            proposals.append(DraftProposal(token, q_ids, q_probs))
            if i + 1 < k:
                logits = state.forward([token], last_only=True)  # [1, V]
            else:
                state.tokens.append(token)            # seen, not yet cached: no logits needed past k
        return proposals
