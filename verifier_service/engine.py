"""The target model: per-session KV caches and one forward pass per Verify.

A Verify feeds the newly committed tokens plus the k draft tokens in a single
forward pass (k + 1 positions scored), then hands the target's processed
distributions to `score_draft`, which returns p_i(x_i), a recovered token per
position and the bonus token. Only those O(k) numbers leave this process.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from specmesh.session_cache import SessionCache
from specmesh.config import VerifierConfig
from specmesh.errors import InvalidArgument, ResourceExhausted, check_token_ids
from specmesh.kv import KVSession, cache_nbytes
from specmesh.models import LoadedModel
from specmesh.proposal import MAX_PROPOSAL_SUPPORT, DraftProposal
from specmesh.sampling import SamplingParams, process_logits
from specmesh import tree
from specmesh.speculative import Scores, TreeScores, score_draft, score_tree
from verifier_service.batching import batched_forward

log = logging.getLogger("specmesh.verifier")


@dataclass(frozen=True)
class VerifyCall:
    """One Verify: sync the session's cache to the committed tokens, then score its proposals."""

    session_id: str
    start: int                          # committed tokens the cache keeps (CacheSync.start)
    tail: Sequence[int]                 # committed tokens to append
    proposals: Sequence[DraftProposal]
    params: SamplingParams
    seed: int
    prefix_fingerprint: int | None = None   # of tail's start; None: trusted (in-process callers)
    return_features: bool = False           # also return the features of every fed position (EAGLE drafts)
    parents: Sequence[int] = ()             # a draft tree's (specmesh.tree); empty: the proposals are a chain


@dataclass(frozen=True)
class Verified:
    """What a Verify returns: the scores, the cache's length, and the fed positions' features when asked."""

    scores: Scores | TreeScores
    cached_len: int
    features_start: int = 0
    features: torch.Tensor | None = None    # [fed, H] float16 (the wire's) from position features_start on


# Uncached tokens in one Verify from which it is a cache rebuild (a step syncs a handful); the
# prefill_threads help in specmesh/config.py names it.
REBUILD_TOKENS = 64


class TargetEngine:
    def __init__(self, loaded: LoadedModel, config: VerifierConfig):
        self.model = loaded.model
        self.info = loaded.info
        text = loaded.model.config.get_text_config() if hasattr(loaded.model.config, "get_text_config") \
            else loaded.model.config
        self.feature_dim = int(text.hidden_size)   # a feature row's width: what an EAGLE draft reads
        self.sessions: SessionCache[KVSession] = SessionCache(
            config.max_sessions, config.session_idle_s, max_bytes=config.max_cache_bytes,
            size_of=lambda session: cache_nbytes(session.cache))
        self.prefill_threads = config.prefill_threads
        # A Verify of k draft tokens' cost / one of none, k = 0, 1, ... (verifier_service/verify_cost.py):
        # measured by the server before it serves; empty until then.
        self.verify_cost: list[float] = []

    def _check_tokens(self, field: str, tokens: Sequence[int]) -> None:
        check_token_ids(field, tokens, self.info.vocab_size)

    def prefill(self, session_id: str, tokens: Sequence[int],
                features: bool = False) -> tuple[int, torch.Tensor | None]:
        """Build the session's cache; returns its length and, with `features`, [n, H] the prompt's features."""
        if not tokens:
            raise InvalidArgument("token_ids", "must not be empty")
        self._check_tokens("token_ids", tokens)
        self._check_context(len(tokens))
        session = KVSession(session_id, self.model)
        session.sync(0, tokens)
        with torch_threads(self.prefill_threads):
            session.forward(last_only=True, features=features)
        rows, session.fed_features = session.fed_features, None
        self.sessions.put(session_id, session)
        self.sessions.trim(keep=session_id)
        # In the wire's float16 here, on the model thread: a conversion this big is a parallel op, and one
        # on the servicer's thread gives the process a second OpenMP team (see EngineHost.load).
        return len(session.tokens), (rows[1].to(torch.float16) if rows is not None else None)

    def verify_batch(self, calls: Sequence[VerifyCall]) -> list[Verified | Exception]:
        """Several sessions' Verify in one forward pass; each call's error stays its own.

        A session named twice (two streams driving one session id) gets its later
        calls run after the first, never twice in one pass over one cache.
        """
        seen: set[str] = set()
        first = [i for i, call in enumerate(calls) if not (call.session_id in seen or seen.add(call.session_id))]
        later = [i for i in range(len(calls)) if i not in set(first)]
        results: list = [None] * len(calls)
        ready = []
        for i in first:
            try:
                ready.append((i, self._sync(calls[i]), calls[i]))
            except Exception as error:  # noqa: BLE001 - reported to that caller only
                results[i] = error
        if ready:
            sessions = [session for _, session, _ in ready]
            first_positions = [len(session.tokens) for session in sessions]   # position of draft token 0
            drafts = [[d.token_id for d in call.proposals] for _, _, call in ready]
            # A Verify that rebuilds a lost cache (failover, eviction) reads a prompt's worth of tokens: it
            # gets the prefill's threads too, for this pass only.
            rebuild = max(len(session.tokens) - session.cached_len for session in sessions) >= REBUILD_TOKENS
            with torch_threads(self.prefill_threads if rebuild else 0):
                rows = batched_forward(self.model, sessions, drafts, [call.return_features for _, _, call in ready],
                                       [call.parents or None for _, _, call in ready])  # each [k_i + 1, V]
            for (i, session, call), logits, position in zip(ready, rows, first_positions):
                fed, session.fed_features = session.fed_features, None
                try:
                    probs = process_logits(logits, call.params)                 # [k + 1, V]
                    tokens = [d.token_id for d in call.proposals]
                    scores = score_tree(probs, tokens, call.parents, call.seed, position,
                                        greedy=call.params.greedy) if call.parents \
                        else score_draft(probs, tokens, [d.q_ids for d in call.proposals],
                                         [d.q_probs for d in call.proposals], call.seed, position)
                    results[i] = Verified(scores, len(session.tokens),
                                          *((fed[0], fed[1].to(torch.float16)) if fed is not None else (0, None)))
                except Exception as error:  # noqa: BLE001 - reported to that caller only
                    results[i] = error
        if later:
            for i, result in zip(later, self.verify_batch([calls[i] for i in later])):
                results[i] = result
        for call in calls:
            self.sessions.trim(keep=call.session_id)
        return results

    def _sync(self, call: VerifyCall) -> KVSession:
        session_id, start, tail, drafts = call.session_id, call.start, call.tail, call.proposals
        self._check_tokens("sync.token_ids", tail)
        self._check_tokens("proposals", [d.token_id for d in drafts])
        for i, d in enumerate(drafts):
            self._check_proposal(i, d)
        if call.parents:
            tree.check_parents(call.parents, len(drafts))
        if start == 0:   # a full resend (first call, or repairing a cache miss) starts afresh
            session = KVSession(session_id, self.model)
            session.sync(0, tail)
            if not session.tokens:
                raise InvalidArgument("sync", "the session has no tokens")
            self._check_context(len(session.tokens) + len(drafts) + 1)
            self.sessions.put(session_id, session)   # only once valid: a bad call evicts no one
            return session
        session = self.sessions.get(session_id) or KVSession(session_id, self.model)  # sync raises CacheMiss
        session.sync(start, tail, call.prefix_fingerprint)
        self._check_context(len(session.tokens) + len(drafts) + 1)
        return session

    def _check_proposal(self, index: int, d: DraftProposal) -> None:
        """A proposal is a small distribution over real token ids, or it cannot be scored."""
        field = f"proposals[{index}]"
        if len(d.q_ids) != len(d.q_probs) or not 0 < len(d.q_ids) <= MAX_PROPOSAL_SUPPORT:
            raise InvalidArgument(field, f"q_ids and q_probs must have the same length in [1, {MAX_PROPOSAL_SUPPORT}]")
        self._check_tokens(f"{field}.q_ids", d.q_ids.tolist())
        if not bool(torch.isfinite(d.q_probs).all()) or bool((d.q_probs < 0).any()):
            raise InvalidArgument(f"{field}.q_probs", "must be finite and >= 0")
        total = float(d.q_probs.double().sum())
        if abs(total - 1.0) > 1e-3:   # a draft's float32 renormalising errs by ~1e-7
            raise InvalidArgument(f"{field}.q_probs", f"must sum to 1, got {total}")
        if d.draft_prob <= 0:
            raise InvalidArgument(field, "the draft token must have probability > 0 in its own q")

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None

    def _check_context(self, length: int) -> None:
        if length > self.info.max_context:
            raise ResourceExhausted(f"sequence of {length} tokens exceeds the model's context of {self.info.max_context}")


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run torch with `threads` intra-op threads inside (0: as it is), restored after; called on the model
    thread. The logits keep their bits: a 1,100-token prompt of the default target read on 2 threads gave
    its logits, and those of the steps after it, bit for bit as on 1 (the batch-invariant kernels;
    tests/test_prefill_threads.py checks a small model)."""
    before = torch.get_num_threads()
    if not threads or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
