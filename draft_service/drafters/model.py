"""Drafting with a small causal LM that shares the target's vocabulary.

Each draft token is sampled from the draft's distribution after the same
temperature / top-k / top-p processing as the target's, truncated to its
top_n tokens (a truncated q is still a valid proposal: the rule stays exact
and only O(top_n) numbers per position go on the wire).

Two kinds of draft folder load here: a plain Hugging Face causal LM over the
target's whole vocabulary, and a distilled draft (`specmesh distill`) over a
subset of it, whose proposals are mapped back to target ids.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from specmesh.config import DraftConfig
from specmesh.fast_linear import apply_kernels
from specmesh.distilled import DistilledDraft, cut_head, is_distilled_draft, load_draft, mask_other
from specmesh.drafts import resolve_draft
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
        if not config.draft_model or config.draft_model.strip().lower() == "none":
            return None
        return _load(config.draft_model, config.device, config.draft_head_tokens, config.linear_kernels,
                     config.batch_invariant, config.min_product_rows)

    def new_state(self, session_id: str) -> KVSession:
        return KVSession(session_id, self.model)

    def distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[V'] draft logits -> [V'] processed probabilities q."""
        return process_logits(logits, params)

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def propose(self, state: KVSession, k: int, params: SamplingParams, seed: int,
                top_n: int) -> list[DraftProposal]:
        proposals: list[DraftProposal] = []
        logits = state.forward(last_only=True)          # [1, V']: predicts position len(state.tokens)
        for i in range(k):
            probs = self.distribution(logits[-1], params)  # [V']
            index, q_index, q_probs = draft_token(probs, top_n, seed, len(state.tokens))
            token = int(self.target_ids(torch.tensor(index)))
            proposals.append(DraftProposal(token, self.target_ids(q_index), q_probs))
            if i + 1 < k:
                logits = state.forward([token], last_only=True)  # [1, V']
            else:
                state.tokens.append(token)            # seen, not yet cached: no logits needed past k
        return proposals


class DistilledDrafter(ModelDrafter):
    """A draft over a subset of the target's vocabulary (see specmesh.distilled).

    q is computed over the subset: temperature, top-k and top-p act on it as
    they act on p, and every token outside it has q = 0. Sampling is the same
    draft_token call as for a full-vocabulary draft; only the ids it returns
    are mapped to target ids.
    """

    def __init__(self, draft: DistilledDraft):
        super().__init__(draft)
        self.target_to_draft = draft.target_to_draft      # [V_target] int64
        self.draft_to_target = draft.draft_to_target      # [n_out] int64

    def new_state(self, session_id: str) -> KVSession:
        return _MappedSession(session_id, self.model, self.target_to_draft)

    def distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(mask_other(logits), params)  # [n_out]

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[ids.to(self.draft_to_target.device)].cpu()


@functools.lru_cache(maxsize=4)
def _load(spec: str, device: str, head_tokens: int, kernels: str, batch_invariant: bool,
          min_rows: int) -> ModelDrafter:
    """One drafter per (model, device, head, kernels), shared by every drafter built on it (model,
    hybrid), its kernels set up once (their probes and timing included)."""
    spec = resolve_draft(spec)
    if is_distilled_draft(spec):
        draft = load_draft(spec, device=device)
        cut_head(draft.model, head_tokens)
        drafter = DistilledDrafter(draft)
    else:
        drafter = ModelDrafter(load_model(spec, device=device))
    apply_kernels(drafter.model, kernels, batch_invariant, min_rows)
    return drafter


class _MappedSession(KVSession):
    """Tokens stay target ids (what the orchestrator syncs); the model reads draft ids."""

    def __init__(self, session_id: str, model, target_to_draft: torch.Tensor):
        super().__init__(session_id, model)
        self.target_to_draft = target_to_draft

    def model_input(self, feed: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([feed], dtype=torch.long, device=self.target_to_draft.device)  # [1, T] target ids
        return self.target_to_draft[ids]                                                  # [1, T] draft ids
