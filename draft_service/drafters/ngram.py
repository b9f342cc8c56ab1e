"""Model-free prompt lookup (n-gram) drafting.

Find the most recent earlier occurrence of the last n tokens in the prompt and
the text so far, and propose what followed it (Saxena 2023, "Prompt Lookup
Decoding"; the same idea as vLLM's ngram proposer). Strong on summarization,
extraction and code editing, where the output copies the input.

The proposal is deterministic, so q is a point mass and the acceptance rule
accepts token x with probability p(x), which keeps sampling exact.
"""
from __future__ import annotations

from specmesh.config import DraftConfig
from specmesh.kv import TokenHistory
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from draft_service.drafters.base import Drafter, register


@register
class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @classmethod
    def from_config(cls, config: DraftConfig) -> "NgramDrafter":
        return cls(config.ngram_max, config.ngram_min)

    def propose(self, state: TokenHistory, k: int, params: SamplingParams, seed: int,
                top_n: int) -> list[DraftProposal]:
        continuation = lookup(state.tokens, k, self.max_ngram, self.min_ngram)
        state.tokens.extend(continuation)
        return [DraftProposal.point_mass(t) for t in continuation]


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # Newest match first: recent text predicts the next text best.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
