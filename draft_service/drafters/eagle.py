"""Drafting with an EAGLE-style draft that reads the target's features (specmesh.eagle).

At position j the draft reads (token x_j, the target's feature f_{j-1}). The
orchestrator sends the target's real features with every committed token
(ProposeRequest.features); drafting k tokens ahead, the draft's own output h_j
stands in for f_j. KV entries computed from the draft's stand-ins are only
valid for those drafts: when draft tokens are accepted, the orchestrator syncs
them again (its draft handle stays at the step's start), and they are fed anew
with the real features. So the cache here covers only positions fed with real
features (`real_len`); everything past it is cropped at the next sync.

Sampling is the distilled draft's: q over the draft's vocabulary subset,
processed like p, truncated to top_n, drawn with (seed, position).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from specmesh import engine_host
from specmesh.config import DraftConfig
from specmesh.distilled import DistilledDraft, cut_head, mask_other
from specmesh.drafts import resolve_draft
from specmesh.eagle import grow_tree, load_eagle
from specmesh.fast_linear import apply_kernels
from specmesh.kv import PREFILL_CHUNK, TokenHistory, tensor_bytes
from specmesh.lean_decoder import lean_decoder
from specmesh.padded_cache import new_cache
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams, process_logits
from specmesh.speculative import draft_token
from draft_service.drafters.base import Drafter, register


class EagleState(TokenHistory):
    """A session's target-id tokens, the target's feature before each committed position, and the draft's KV."""

    def __init__(self, session_id: str, draft: DistilledDraft):
        super().__init__(session_id)
        self.model = draft.model
        self.target_to_draft = draft.target_to_draft                  # [V_target] int64
        # prev_features[j] = f_{j-1}, the feature position j reads (zeros for j = 0); wire precision.
        self.prev_features = torch.zeros(0, self.model.hidden_size, dtype=torch.float16)   # [committed, H]
        self.cache = new_cache(self.model.config)
        self.real_len = 0       # leading cache entries computed from real features; the rest are drafts'

    def sync(self, start: int, tail: Sequence[int], prefix_fingerprint: int | None = None,
             features: torch.Tensor | None = None) -> None:
        """TokenHistory.sync; `features` [len(tail), H]: the feature before each tail position."""
        super().sync(start, tail, prefix_fingerprint)
        rows = features if features is not None else torch.zeros(len(tail), self.model.hidden_size)
        self.prev_features = torch.cat([self.prev_features[:start], rows.to(torch.float16)])
        self.real_len = min(start, self.real_len)
        self._crop(self.real_len)

    def nbytes(self, seen: set) -> int:
        return tensor_bytes(self.prev_features, seen)

    def _crop(self, length: int) -> None:
        held = self.cache.get_seq_length()
        if held > length:
            self.cache.crop(length - held)   # negative: drop that many from the end

    def _run(self, ids: Sequence[int], prev: torch.Tensor, logits_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed target ids with the features before them; -> (logits [rows, n_out + 1], hidden [T, H])."""
        device = self.model.device
        input_ids = self.target_to_draft[torch.tensor([list(ids)], dtype=torch.long, device=device)]   # [1, T]
        logits, hidden = self.model(input_ids, prev[None].to(device, torch.float32), cache=self.cache,
                                    logits_rows=logits_rows)
        return logits[0].float(), hidden[0]

    @torch.inference_mode()
    def feed_committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every committed position not yet cached with real features; -> (logits [n_out + 1] at the
        last committed position, its hidden [H]). The last one is fed again when all are cached."""
        n = len(self.prev_features)
        assert n and n == len(self.tokens), "feed before the committed tokens and their features were synced"
        start = min(self.real_len, n - 1)
        self._crop(start)
        while n - start > PREFILL_CHUNK + 1:   # a long feed in chunks: abandoned work stops at the next one
            engine_host.check_abandoned()
            self._run(self.tokens[start:start + PREFILL_CHUNK], self.prev_features[start:start + PREFILL_CHUNK])
            start += PREFILL_CHUNK
        engine_host.check_abandoned()
        logits, hidden = self._run(self.tokens[start:n], self.prev_features[start:n])
        self.real_len = n
        return logits[-1], hidden[-1]

    @torch.inference_mode()
    def feed_draft(self, token: int, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one draft token with the draft's own stand-in feature; -> (logits [n_out + 1], hidden [H])."""
        logits, hidden = self._run([token], prev[None])
        self.tokens.append(token)
        return logits[-1], hidden[-1]


@register
class EagleDrafter(Drafter):
    name = "eagle"
    uses_target_features = True
    grows_trees = True

    def __init__(self, draft: DistilledDraft, tree_branch: int = 1, tree_depth: int = 6,
                 tree_min_confidence: float | None = None):
        self.draft = draft
        self.tree_branch = tree_branch                                # > 1: propose draft trees
        self.tree_depth = tree_depth
        # This replica's own cut, or None: each Propose's (the orchestrator's, orchestrator/tree_cut.py).
        self.tree_min_confidence = tree_min_confidence
        self.model = draft.model
        self.model_name = draft.info.name
        self.vocab_size = draft.info.vocab_size
        self.vocab_fingerprint = draft.info.vocab_fingerprint
        self.max_context = draft.info.max_context
        self.feature_dim = draft.model.hidden_size
        self.target_to_draft = draft.target_to_draft                  # [V_target] int64
        self.draft_to_target = draft.draft_to_target                  # [n_out] int64

    @classmethod
    def from_config(cls, config: DraftConfig) -> "EagleDrafter | None":
        if not config.eagle_model or config.eagle_model.strip().lower() == "none":
            return None
        return _load(config.eagle_model, config.device, config.draft_head_tokens, config.tree_branch,
                     config.tree_depth, config.tree_min_confidence, config.linear_kernels, config.batch_invariant,
                     config.min_product_rows)

    def new_state(self, session_id: str) -> EagleState:
        return EagleState(session_id, self.draft)

    def tree_shape(self, k: int) -> tuple[int, int] | None:
        """(depth, branch) of the draft tree a Propose of k grows, or None: it proposes a chain."""
        return (min(k, self.tree_depth), self.tree_branch) if self.tree_branch > 1 and k > 1 else None

    def read(self, state: EagleState) -> None:
        state.feed_committed()

    def min_score(self, requested: float | None = None) -> float:
        """The log-chance a tree node's whole path must reach: from this replica's cut when it has one, else
        from the Propose's, else -inf (every tree has k nodes)."""
        confidence = self.tree_min_confidence if self.tree_min_confidence is not None else requested
        return math.log(confidence) if confidence else -math.inf

    def propose(self, state: EagleState, k: int, params: SamplingParams, seed: int,
                top_n: int, tree_min_confidence: float | None = None) -> list[DraftProposal]:
        logits, hidden = state.feed_committed()              # [n_out + 1], [H]: predicts position len(tokens)
        shape = self.tree_shape(k)
        if shape is not None:
            return self._tree(state, logits, hidden, k, *shape, params, self.min_score(tree_min_confidence))
        proposals: list[DraftProposal] = []
        for i in range(k):
            probs = process_logits(mask_other(logits), params)                     # [n_out]
            index, q_index, q_probs = draft_token(probs, top_n, seed, len(state.tokens))
            token = int(self.draft_to_target[index])
            proposals.append(DraftProposal(token, self.draft_to_target[q_index.to(self.draft_to_target.device)].cpu(),
                                           q_probs))
            if i + 1 < k:
                logits, hidden = state.feed_draft(token, hidden)
            else:
                state.tokens.append(token)            # seen, not yet cached: no logits needed past k
        return proposals

    def _tree(self, state: EagleState, logits: torch.Tensor, hidden: torch.Tensor, k: int, depth: int, branch: int,
              params: SamplingParams, min_score: float) -> list[DraftProposal]:
        """A draft tree of k nodes (specmesh.eagle.grow_tree), ranked by the draft's q under the request's
        sampling (greedy ranks by the plain softmax: its one-hot q would rank nothing). Its proposals are
        point masses: the verifier tries siblings in order (specmesh.speculative.accept_tree). The state's
        tokens stay the committed ones: the next sync brings what was accepted, with real features."""
        def rank(rows: torch.Tensor) -> torch.Tensor:                            # [N, n_out + 1] -> [N, n_out]
            rows = mask_other(rows).float()
            return torch.log_softmax(rows, dim=-1) if params.greedy else torch.log(process_logits(rows, params))

        with torch.inference_mode():
            ids, parents = grow_tree(self.model, state.cache, len(state.tokens), logits, hidden, k,
                                     depth=depth, branch=branch, rank=rank, min_score=min_score)
        tokens = self.draft_to_target[torch.tensor(ids, dtype=torch.long, device=self.draft_to_target.device)]
        return [DraftProposal.point_mass(int(t), parent) for t, parent in zip(tokens.tolist(), parents)]


@functools.lru_cache(maxsize=4)
def _load(spec: str, device: str, head_tokens: int, tree_branch: int, tree_depth: int,
          tree_min_confidence: float | None, kernels: str, batch_invariant: bool, min_rows: int) -> EagleDrafter:
    """One drafter per configuration, shared by every drafter built on it (eagle, eagle-hybrid), its
    kernels set up once (their probes and timing included)."""
    draft = load_eagle(resolve_draft(spec), device=device)
    cut_head(draft.model.lm, head_tokens)
    drafter = EagleDrafter(draft, tree_branch, tree_depth, tree_min_confidence)
    apply_kernels(drafter.model, kernels, batch_invariant, min_rows)
    if drafter.model.lean is None:   # after the kernels: it runs the layers as they will be served
        drafter.model.lean = lean_decoder(drafter.model.lm.model)
    return drafter
