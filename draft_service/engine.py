"""The draft tier's engine: the drafters this replica serves and each session's state."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from specmesh.cache_store import SessionStore
from specmesh.config import DraftConfig
from specmesh.errors import InvalidArgument, check_token_ids
from specmesh.kv import TokenHistory
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
        self.default_drafter = config.default_drafter or default_drafter(config.draft_model, set(drafters))
        if self.default_drafter not in drafters:
            raise ValueError(f"default drafter {self.default_drafter!r} is not served here; "
                             f"available: {sorted(drafters)}")
        self.sessions: SessionStore[DraftSession] = SessionStore(config.max_sessions, config.session_idle_s)

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
                params: SamplingParams, seed: int, top_n: int) -> tuple[list[DraftProposal], int]:
        name = drafter_name or self.default_drafter
        drafter = self.drafters.get(name)
        if drafter is None:
            raise InvalidArgument("drafter", f"unknown drafter {name!r}; this replica serves {sorted(self.drafters)}")
        if not 0 <= k <= self.max_k:
            raise InvalidArgument("k", f"must be in [0, {self.max_k}], got {k}")
        if not 1 <= top_n <= MAX_PROPOSAL_SUPPORT:
            raise InvalidArgument("top_n", f"must be in [1, {MAX_PROPOSAL_SUPPORT}], got {top_n}")
        if drafter.vocab_size:   # 0: a vocabulary-agnostic drafter
            check_token_ids("sync.token_ids", tail, drafter.vocab_size)
        session = self.sessions.get(session_id)
        if start == 0 or session is None or session.drafter != name:
            # A full resend (or a first call) starts afresh; anything else without state is a cache miss.
            session = DraftSession(name, drafter.new_state(session_id))
            session.state.sync(start, tail)
            if not session.state.tokens:
                raise InvalidArgument("sync", "the session has no tokens")
            self.sessions.put(session_id, session)   # only once valid: a bad call evicts no one
        else:
            session.state.sync(start, tail)
        proposals = drafter.propose(session.state, k, params, seed, top_n) if k else []
        return proposals, len(session.state.tokens)

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None
