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
        self.default_drafter = config.default_drafter or default_drafter(config.draft_model, set(drafters))
        if self.default_drafter not in drafters:
            raise ValueError(f"default drafter {self.default_drafter!r} is not served here; "
                             f"available: {sorted(drafters)}")
        self.sessions: SessionCache[DraftSession] = SessionCache(
            config.max_sessions, config.session_idle_s, max_bytes=config.max_cache_bytes,
            size_of=lambda session: cache_nbytes(getattr(session.state, "cache", None)))

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
                prefix_fingerprint: int | None = None) -> tuple[list[DraftProposal], int]:
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
        if drafter.vocab_size:   # 0: a vocabulary-agnostic drafter
            check_token_ids("sync.token_ids", tail, drafter.vocab_size)
        if drafter.max_context and start + len(tail) + k > drafter.max_context:
            raise ResourceExhausted(f"sequence of {start + len(tail) + k} tokens exceeds the {name} drafter's "
                                    f"context of {drafter.max_context}")
        session = self.sessions.get(session_id)
        if start == 0 or session is None or session.drafter != name:
            # A full resend (or a first call) starts afresh; anything else without state is a cache miss.
            session = DraftSession(name, drafter.new_state(session_id))
            session.state.sync(start, tail)
            if not session.state.tokens:
                raise InvalidArgument("sync", "the session has no tokens")
            self.sessions.put(session_id, session)   # only once valid: a bad call evicts no one
        else:
            session.state.sync(start, tail, prefix_fingerprint)
        proposals = drafter.propose(session.state, k, params, seed, top_n) if k else []
        self.sessions.trim(keep=session_id)
        return proposals, len(session.state.tokens)

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None
