"""The speculative decoding loop for one session.

Each step: Propose k draft tokens on the session's draft replica, Verify them
on its verifier replica in one forward pass, apply the acceptance rule
(orchestrator.acceptance), commit the accepted tokens plus one recovered or
bonus token to Redis, and stream them. k = 0 is target-only decoding through
the same services: the baseline every speedup is measured against.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from orchestrator.acceptance import accept
from orchestrator.replicas import ReplicaPool
from orchestrator.requests import GenerationRequest
from orchestrator.sessions import Handle, SessionStore
from orchestrator.text import TextStream
from specmesh import telemetry, wire
from specmesh.sampling import Scores
from specmesh.v1 import cache_pb2, draft_pb2, verifier_pb2

log = logging.getLogger("specmesh.orchestrator")


@dataclass
class Stats:
    prompt_tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Committed tokens per step: accepted draft tokens + the recovered/bonus one."""
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.generated_tokens else 0.0

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first_token_at - self.started) if self.first_token_at else 0.0


@dataclass
class Chunk:
    session_id: str
    token_ids: list[int]
    text: str
    stats: Stats
    draft_tokens: int = 0
    accepted_tokens: int = 0
    bonus: bool = False
    finish_reason: str = ""


class Decoder:
    """Runs sessions against the replica pools; one instance per orchestrator."""

    def __init__(self, sessions: SessionStore, drafts: ReplicaPool, verifiers: ReplicaPool, tokenizer,
                 eos_token_ids: set[int], draft_top_n: int, rpc_timeout_s: float):
        self.sessions, self.drafts, self.verifiers = sessions, drafts, verifiers
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.draft_top_n = draft_top_n
        self.rpc_timeout_s = rpc_timeout_s

    async def run(self, req: GenerationRequest) -> AsyncIterator[Chunk]:
        stats = Stats(prompt_tokens=len(req.prompt_ids))
        await self.sessions.create(req.session_id, req.prompt_ids, _params_record(req), req.seed)
        draft, verifier = Handle(cache_id=req.session_id), Handle(cache_id=req.session_id)
        committed = list(req.prompt_ids)
        text = TextStream(self.tokenizer, req.stop)
        tracer = telemetry.tracer()                  # the API's no-op tracer unless tracing is on
        telemetry.bind_session(req.session_id)       # session id on the Generate span and in log records
        telemetry.record_request_start(req.drafter, len(req.prompt_ids))
        finish = ended = ""
        prefill = None
        try:
            yield Chunk(req.session_id, [], "", stats)
            # The target reads the prompt while the draft makes its first proposal.
            prefill = asyncio.ensure_future(self._prefill(req, list(committed)))
            while not finish:
                step_started = time.perf_counter()
                # The span ends before the yield: a step's children are Propose, Verify, accept and commit.
                with tracer.start_as_current_span(telemetry.SPAN_STEP) as span:
                    generated = len(committed) - len(req.prompt_ids)
                    # Never draft past max_new_tokens: all k accepted plus a bonus is k + 1 tokens.
                    k = min(req.k, req.max_new_tokens - generated - 1)
                    proposals, draft_len = [], 0
                    if k > 0:
                        draft, proposals, draft_len = await self._propose(req, draft, committed, k)
                    if prefill is not None:
                        verifier, prefill = await prefill, None
                    verifier, scores, verifier_len = await self._verify(req, verifier, committed, proposals)
                    start = len(committed)
                    with tracer.start_as_current_span(telemetry.SPAN_ACCEPT):
                        result = accept([p.token_id for p in proposals], [p.draft_prob for p in proposals], scores,
                                        req.seed, start)
                    # The replicas hold the drafts too; only the accepted prefix of them stays valid.
                    valid = start + result.accepted
                    verifier.cached_len = min(verifier_len, valid)
                    if proposals:
                        draft.cached_len = min(draft_len, valid)
                    new, finish = self._cut(result.tokens, generated, req.max_new_tokens)
                    with tracer.start_as_current_span(telemetry.SPAN_COMMIT):
                        status = await self.sessions.commit(req.session_id, start, new, stats.steps + 1, draft,
                                                            verifier)
                    if status == "cancelled":   # Redis kept nothing of this step: neither does the client
                        new, finish = [], "cancelled"
                    committed += new
                    stats.steps += 1
                    stats.draft_tokens += len(proposals)
                    stats.accepted_tokens += result.accepted
                    stats.generated_tokens += len(new)
                    first_token = stats.first_token_at is None and bool(new)
                    if first_token:
                        stats.first_token_at = time.perf_counter()
                    delta = text.update(committed[len(req.prompt_ids):], final=bool(finish))
                    if text.stopped and finish != "cancelled":
                        finish = "stop"
                    if span.is_recording():
                        span.set_attributes({telemetry.ATTR_STEP: stats.steps, telemetry.ATTR_K: k,
                                             telemetry.ATTR_DRAFT_TOKENS: len(proposals),
                                             telemetry.ATTR_ACCEPTED_TOKENS: result.accepted,
                                             telemetry.ATTR_BONUS: result.bonus, telemetry.ATTR_NEW_TOKENS: len(new)})
                telemetry.record_step(req.drafter, len(proposals), result.accepted, len(new),
                                      time.perf_counter() - step_started,
                                      stats.time_to_first_token_s if first_token else None)
                yield Chunk(req.session_id, new, delta, stats, len(proposals), result.accepted, result.bonus, finish)
            ended = finish
        finally:
            if prefill is not None:   # the loop failed before using it
                prefill.cancel()
                if prefill.done() and not prefill.cancelled():
                    prefill.exception()   # retrieved: asyncio would otherwise log it as lost
            telemetry.record_request_end(req.drafter, ended, stats.elapsed_s,
                                         stats.time_to_first_token_s if stats.first_token_at else None,
                                         stats.generated_tokens)
            # Counts only: prompts and outputs are never logged at INFO.
            log.info("session finished (%s): %d tokens in %d steps, %d of %d draft tokens accepted, %.2f s",
                     ended or "aborted", stats.generated_tokens, stats.steps, stats.accepted_tokens,
                     stats.draft_tokens, stats.elapsed_s)
            await asyncio.shield(self._release(req.session_id, draft, verifier))

    def _cut(self, tokens: list[int], generated: int, max_new: int) -> tuple[list[int], str]:
        """Stop at the first EOS (kept in the ids) or at max_new_tokens."""
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                return tokens[:i + 1], "stop"
        tokens = tokens[:max_new - generated]
        return tokens, "length" if generated + len(tokens) >= max_new else ""

    async def _prefill(self, req: GenerationRequest, committed: list[int]) -> Handle:
        async def rpc(replica, start):
            return await replica.stub.Prefill(
                verifier_pb2.PrefillRequest(session_id=req.session_id, token_ids=committed),
                timeout=self.rpc_timeout_s)

        replica, reply = await self.verifiers.call(Handle(), committed, rpc)
        return Handle(replica.address, req.session_id, reply.cached_len)

    async def _propose(self, req: GenerationRequest, handle: Handle, committed: list[int], k: int):
        async def rpc(replica, start):
            return await replica.stub.Propose(draft_pb2.ProposeRequest(
                session_id=req.session_id, sync=cache_pb2.CacheSync(start=start, token_ids=committed[start:]),
                k=k, drafter=req.drafter, sampling=wire.sampling_to_pb(req.params), seed=req.seed,
                top_n=self.draft_top_n), timeout=self.rpc_timeout_s)

        replica, reply = await self.drafts.call(handle, committed, rpc)
        proposals = [wire.proposal_from_pb(t) for t in reply.tokens]
        return Handle(replica.address, req.session_id, handle.cached_len), proposals, reply.cached_len

    async def _verify(self, req: GenerationRequest, handle: Handle, committed: list[int], proposals):
        draft_tokens = [wire.proposal_to_pb(p) for p in proposals]

        async def rpc(replica, start):
            return await replica.stub.Verify(verifier_pb2.VerifyRequest(
                session_id=req.session_id, sync=cache_pb2.CacheSync(start=start, token_ids=committed[start:]),
                draft_tokens=draft_tokens, sampling=wire.sampling_to_pb(req.params), seed=req.seed),
                timeout=self.rpc_timeout_s)

        replica, reply = await self.verifiers.call(handle, committed, rpc)
        scores = Scores(list(reply.target_probs), list(reply.recovered_tokens), reply.bonus_token)
        return Handle(replica.address, req.session_id, handle.cached_len), scores, reply.cached_len

    async def _release(self, session_id: str, draft: Handle, verifier: Handle) -> None:
        """Free both caches and the Redis record; a failure here only costs memory until TTL/eviction."""
        request = cache_pb2.ReleaseRequest(session_id=session_id)
        calls = [self.sessions.release(session_id)]
        for pool, handle in ((self.drafts, draft), (self.verifiers, verifier)):
            replica = next((r for r in pool.replicas if r.address == handle.replica), None)
            if replica is not None:
                calls.append(replica.stub.Release(request, timeout=5))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.warning("release of session %s incomplete: %s", session_id, outcome)


def _params_record(req: GenerationRequest) -> dict:
    return {"temperature": req.params.temperature, "top_k": req.params.top_k, "top_p": req.params.top_p,
            "k": req.k, "drafter": req.drafter, "max_new_tokens": req.max_new_tokens, "stop": list(req.stop)}
