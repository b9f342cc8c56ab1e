"""The one interface every drafter implements, and the registry.

A drafter turns a session's token history into k draft tokens, each with the
(truncated) proposal distribution q it was sampled from. Adding a drafter is
adding one module to this package that defines a subclass decorated with
@register; the package imports every module in it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from specmesh.config import DraftConfig
from specmesh.kv import TokenHistory
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams

REGISTRY: dict[str, type["Drafter"]] = {}


def register(cls: type["Drafter"]) -> type["Drafter"]:
    assert cls.name not in REGISTRY, f"two drafters are named {cls.name!r}"
    REGISTRY[cls.name] = cls
    return cls


class Drafter(ABC):
    name: ClassVar[str]
    model_name: str = ""            # empty for model-free drafters
    vocab_size: int = 0             # 0: works with any vocabulary
    vocab_fingerprint: str = ""     # empty: works with any vocabulary
    max_context: int = 0            # 0: no limit on the sequence length
    uses_target_features: bool = False   # True: each sync carries the target's features (EAGLE)
    feature_dim: int = 0            # their width (the target's hidden size); 0 when unused
    grows_trees: bool = False       # True: proposes draft trees, and its propose takes tree_min_confidence

    @classmethod
    @abstractmethod
    def from_config(cls, config: DraftConfig) -> "Drafter | None":
        """Build the drafter, or None when the configuration does not provide for it."""

    def new_state(self, session_id: str) -> TokenHistory:
        return TokenHistory(session_id)

    @abstractmethod
    def propose(self, state: TokenHistory, k: int, params: SamplingParams, seed: int,
                top_n: int) -> list[DraftProposal]:
        """Draft up to k tokens after state.tokens; append them to state.tokens.

        Draft token i sits at absolute position len(state.tokens) before it is
        appended; sample it with that position so a seeded session reproduces.
        """

    def read(self, state: TokenHistory) -> None:
        """A Propose of 0 tokens: read the synced tokens now, so that the next Propose only drafts.
        Only a drafter whose read is real work does anything (EAGLE: a prompt with its features,
        read while the orchestrator's first Verify runs)."""
