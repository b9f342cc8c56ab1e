"""The target model: per-session KV caches and one forward pass per Verify.

A Verify feeds the newly committed tokens plus the k draft tokens in a single
forward pass (k + 1 positions scored), then hands the target's processed
distributions to `score_draft`, which returns p_i(x_i), a recovered token per
position and the bonus token. Only those O(k) numbers leave this process.
"""
from __future__ import annotations

import logging
from typing import Sequence

from specmesh.cache_store import SessionStore
from specmesh.config import VerifierConfig
from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.kv import KVSession
from specmesh.models import LoadedModel
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams, Scores, process_logits, score_draft
from verifier_service.batching import batched_forward

log = logging.getLogger("specmesh.verifier")


class TargetEngine:
    def __init__(self, loaded: LoadedModel, config: VerifierConfig):
        self.model = loaded.model
        self.info = loaded.info
        self.sessions: SessionStore[KVSession] = SessionStore(config.max_sessions, config.session_idle_s)

    def _check_tokens(self, field: str, tokens: Sequence[int]) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(field, f"token ids must be in [0, {vocab}), got {bad[:5]}")

    def prefill(self, session_id: str, tokens: Sequence[int]) -> int:
        if not tokens:
            raise InvalidArgument("token_ids", "must not be empty")
        self._check_tokens("token_ids", tokens)
        self._check_context(len(tokens))
        session = KVSession(session_id, self.model)
        session.sync(0, tokens)
        session.forward()
        self.sessions.put(session_id, session)
        return len(session.tokens)

    def verify(self, session_id: str, start: int, tail: Sequence[int], drafts: Sequence[DraftProposal],
               params: SamplingParams, seed: int) -> tuple[Scores, int]:
        result = self.verify_batch([(session_id, start, tail, drafts, params, seed)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def verify_batch(self, calls: Sequence[tuple]) -> list[tuple[Scores, int] | Exception]:
        """Several sessions' Verify in one forward pass; each call's error stays its own."""
        results: list = [None] * len(calls)
        ready = []
        for i, call in enumerate(calls):
            try:
                ready.append((i, self._sync(*call[:4]), call))
            except Exception as error:  # noqa: BLE001 - reported to that caller only
                results[i] = error
        if ready:
            sessions = [session for _, session, _ in ready]
            first_positions = [len(session.tokens) for session in sessions]   # position of draft token 0
            drafts = [[d.token_id for d in call[3]] for _, _, call in ready]
            rows = batched_forward(self.model, sessions, drafts)                # each [k_i + 1, V]
            for (i, session, call), logits, position in zip(ready, rows, first_positions):
                _, _, _, proposals, params, seed = call
                probs = process_logits(logits, params)                          # [k + 1, V]
                scores = score_draft(probs, [d.token_id for d in proposals], [d.q_ids for d in proposals],
                                     [d.q_probs for d in proposals], seed, position)
                results[i] = (scores, len(session.tokens))
        return results

    def _sync(self, session_id: str, start: int, tail: Sequence[int], drafts: Sequence[DraftProposal]) -> KVSession:
        self._check_tokens("sync.token_ids", tail)
        self._check_tokens("draft_tokens", [d.token_id for d in drafts])
        if start == 0:   # a full resend (first call, or repairing a cache miss) starts afresh
            session = KVSession(session_id, self.model)
            self.sessions.put(session_id, session)
        else:
            session = self.sessions.get(session_id) or KVSession(session_id, self.model)  # sync raises CacheMiss
        session.sync(start, tail)
        if not session.tokens:
            raise InvalidArgument("sync", "the session has no tokens")
        self._check_context(len(session.tokens) + len(drafts) + 1)
        return session

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None

    def _check_context(self, length: int) -> None:
        if length > self.info.max_context:
            raise ResourceExhausted(f"sequence of {length} tokens exceeds the model's context of {self.info.max_context}")
