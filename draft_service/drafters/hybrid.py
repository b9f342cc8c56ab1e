"""Prompt lookup where the text repeats itself, the draft model everywhere else.

Each step first looks for the longest suffix n-gram (ngram_max tokens, no
shorter) earlier in the session; when one matches, its continuation is the
proposal (point masses, as the n-gram drafter's). Otherwise the model drafts.
A long exact match is strong evidence of copying (summaries, extraction,
edits), where lookup proposes the right span for free; elsewhere the model
is right far more often than a short match. Every step's proposal is a valid
one on its own, so mixing them keeps the acceptance rule exact.
"""
from __future__ import annotations

from specmesh.config import DraftConfig
from specmesh.kv import KVSession
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from draft_service.drafters.base import Drafter, register
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.ngram import lookup


@register
class HybridDrafter(Drafter):
    name = "hybrid"

    def __init__(self, model: ModelDrafter, ngram: int):
        self.model = model
        self.ngram = ngram
        self.model_name, self.vocab_size = model.model_name, model.vocab_size
        self.vocab_fingerprint, self.max_context = model.vocab_fingerprint, model.max_context

    @classmethod
    def from_config(cls, config: DraftConfig) -> "HybridDrafter | None":
        model = ModelDrafter.from_config(config)     # loaded once per configuration (cached)
        return cls(model, config.ngram_max) if model is not None else None

    def new_state(self, session_id: str) -> KVSession:
        return self.model.new_state(session_id)

    def propose(self, state: KVSession, k: int, params: SamplingParams, seed: int,
                top_n: int) -> list[DraftProposal]:
        continuation = lookup(state.tokens, k, self.ngram, self.ngram)
        if continuation:
            state.tokens.extend(continuation)        # not yet cached: the model's next forward feeds them
            return [DraftProposal.point_mass(t) for t in continuation]
        return self.model.propose(state, k, params, seed, top_n)


@register
class EagleHybridDrafter(Drafter):
    """`hybrid` with the EAGLE draft in place of the model: lookup on a long match, EAGLE elsewhere.

    Measured on Spec-Bench (docs/distill.md) the two win on different request types: lookup on
    extraction, summarization and code (text that repeats the prompt), EAGLE on reasoning, roleplay,
    translation and writing. Its state is the EAGLE drafter's, synced with the target's features on
    every step whichever of the two proposed, so EAGLE picks up where lookup left off.
    """

    name = "eagle-hybrid"
    uses_target_features = True
    grows_trees = True

    def __init__(self, eagle, ngram: int):
        self.eagle = eagle
        self.ngram = ngram
        self.model_name, self.vocab_size = eagle.model_name, eagle.vocab_size
        self.vocab_fingerprint, self.max_context = eagle.vocab_fingerprint, eagle.max_context
        self.feature_dim = eagle.feature_dim

    @classmethod
    def from_config(cls, config: DraftConfig) -> "EagleHybridDrafter | None":
        from draft_service.drafters.eagle import EagleDrafter

        eagle = EagleDrafter.from_config(config)     # loaded once per configuration (cached)
        return cls(eagle, config.ngram_max) if eagle is not None else None

    def new_state(self, session_id: str):
        return self.eagle.new_state(session_id)

    def read(self, state) -> None:
        self.eagle.read(state)

    def propose(self, state, k: int, params: SamplingParams, seed: int, top_n: int,
                tree_min_confidence: float | None = None) -> list[DraftProposal]:
        continuation = lookup(state.tokens, k, self.ngram, self.ngram)
        if continuation:
            state.tokens.extend(continuation)        # drafts: the next sync replaces them with what was committed
            return [DraftProposal.point_mass(t) for t in continuation]
        return self.eagle.propose(state, k, params, seed, top_n, tree_min_confidence)
