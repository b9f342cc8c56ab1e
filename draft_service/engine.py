"""The draft tier's engine: the drafters this replica serves and each session's state."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from specmesh.session_cache import SessionCache
from specmesh.config import DraftConfig
from specmesh.bounds import shown
from specmesh.errors import InvalidArgument, ResourceExhausted, check_token_ids
from specmesh.kv import TokenHistory, cache_nbytes
from specmesh.proposal import MAX_PROPOSAL_SUPPORT, DraftProposal
from specmesh.sampling import SamplingParams
from specmesh.drafts import default_drafter
from specmesh.eagle import features_from_bytes
from draft_service.drafters import REGISTRY, Drafter

log = logging.getLogger("specmesh.draft")


@dataclass
class DraftSession:
    drafter: str
    state: TokenHistory


class DraftEngine:
    def __init__(self, drafters: dict[str, Drafter], config: DraftConfig):
        assert drafters, "a draft service needs at least one drafter"
        self.drafters = drafters
        self.max_k = config.max_k
        self.default_top_n = config.default_top_n
        self.default_drafter = config.default_drafter or default_drafter((config.eagle_model, config.draft_model), set(drafters))
        if self.default_drafter not in drafters:
            raise ValueError(f"default drafter {self.default_drafter!r} is not served here; "
                             f"available: {sorted(drafters)}")
        self.sessions: SessionCache[DraftSession] = SessionCache(
            config.max_sessions, config.session_idle_s, max_bytes=config.max_cache_bytes,
            size_of=lambda session: _state_bytes(session.state))

    @classmethod
    def from_config(cls, config: DraftConfig) -> "DraftEngine":
        drafters = {}
        for name, drafter_cls in sorted(REGISTRY.items()):
            drafter = drafter_cls.from_config(config)
            if drafter is not None:
                drafters[name] = drafter
        log.info("drafters served: %s", ", ".join(sorted(drafters)))
        return cls(drafters, config)

    def propose(self, session_id: str, start: int, tail: Sequence[int], k: int, drafter_name: str,
                params: SamplingParams, seed: int, top_n: int,
                prefix_fingerprint: int | None = None, features: bytes = b"",
                tree_min_confidence: float | None = None) -> tuple[list[DraftProposal], int]:
        name = drafter_name or self.default_drafter
        drafter = self.drafters.get(name)
        if drafter is None:
            raise InvalidArgument("drafter",
                                  f"unknown drafter {shown(name)}; this replica serves {sorted(self.drafters)}")
        if not 0 <= k <= self.max_k:
            raise InvalidArgument("k", f"must be in [0, {self.max_k}], got {k}")
        top_n = top_n or self.default_top_n   # 0: the caller left it unset
        if not 1 <= top_n <= MAX_PROPOSAL_SUPPORT:
            raise InvalidArgument("top_n", f"must be in [1, {MAX_PROPOSAL_SUPPORT}], got {top_n}")
        if tree_min_confidence is not None and not 0.0 <= tree_min_confidence < 1.0:
            raise InvalidArgument("tree_min_confidence", f"must be in [0, 1), got {tree_min_confidence}")
        if drafter.vocab_size:   # 0: a vocabulary-agnostic drafter
            check_token_ids("sync.token_ids", tail, drafter.vocab_size)
        if drafter.max_context and start + len(tail) + k > drafter.max_context:
            raise ResourceExhausted(f"sequence of {start + len(tail) + k} tokens exceeds the {name} drafter's "
                                    f"context of {drafter.max_context}")
        # A drafter that reads the target's features gets them with the tokens; the others never see them.
        extra = {"features": _feature_rows(name, drafter, features, len(tail))} if drafter.uses_target_features \
            else {}
        session = self.sessions.get(session_id)
        if start == 0 or session is None or session.drafter != name:
            # A full resend (or a first call) starts afresh; anything else without state is a cache miss.
            session = DraftSession(name, drafter.new_state(session_id))
            session.state.sync(start, tail, **extra)
            if not session.state.tokens:
                raise InvalidArgument("sync", "the session has no tokens")
            self.sessions.put(session_id, session)   # only once valid: a bad call evicts no one
        else:
            session.state.sync(start, tail, prefix_fingerprint, **extra)
        if k:
            cut = {"tree_min_confidence": tree_min_confidence} if drafter.grows_trees else {}
            proposals = drafter.propose(session.state, k, params, seed, top_n, **cut)
        else:   # a sync and a read ahead of the next Propose
            drafter.read(session.state)
            proposals = []
        self.sessions.trim(keep=session_id)
        return proposals, len(session.state.tokens)

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None


def _feature_rows(name: str, drafter: Drafter, data: bytes, rows: int):
    """ProposeRequest.features -> [rows, H]: exactly one row per sync.token_ids entry."""
    if rows and not data:
        raise InvalidArgument("features", f"the {name} drafter reads the target's features: send one row of "
                                          f"{drafter.feature_dim} float16 values per sync.token_ids entry")
    expected = rows * drafter.feature_dim * 2
    if len(data) != expected:
        raise InvalidArgument("features", f"{len(data)} bytes; {rows} sync.token_ids need {rows} rows of "
                                          f"{drafter.feature_dim} float16 values ({expected} bytes)")
    return features_from_bytes(data, drafter.feature_dim)


def _state_bytes(state) -> int:
    """A session's memory: its KV cache, and what else its state holds (an EAGLE state's features)."""
    seen: set = set()
    own = state.nbytes(seen) if hasattr(state, "nbytes") else 0
    return cache_nbytes(getattr(state, "cache", None), seen) + own
