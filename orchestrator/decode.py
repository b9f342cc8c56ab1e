"""The speculative decoding loop for one session.

Each step: Propose k draft tokens on the session's draft replica, Verify them
on its verifier replica in one forward pass, apply the acceptance rule
(specmesh.speculative.accept), commit the accepted tokens plus one recovered
or bonus token to Redis, and stream them. k = 0 is target-only decoding through
the same services: the baseline every speedup is measured against.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry import context as otel_context, trace

from orchestrator.replicas import ReplicaPool
from orchestrator.requests import GenerationRequest
from orchestrator.sessions import Fenced, Handle, SessionLost, SessionStore
from orchestrator.text import TextStream
from orchestrator.tree_cut import tree_min_confidence
from specmesh import auth, telemetry, wire
from specmesh.errors import InvalidArgument, NotFound, PermissionDenied, ServiceError
from specmesh.fingerprint import PrefixFingerprints
from specmesh.sampling import SamplingParams
from specmesh.speculative import Scores, TreeScores, accept, accept_tree
from specmesh.v1 import cache_pb2, draft_pb2, sampling_pb2, verifier_pb2

log = logging.getLogger("specmesh.orchestrator")


@dataclass(frozen=True)
class StepResult:
    """What one step did: propose -> verify -> accept -> commit."""

    k: int                     # draft tokens asked for
    draft_tokens: int          # draft tokens proposed (an n-gram miss proposes none)
    accepted: int              # of those, accepted
    bonus: bool                # all passed: the last committed token is the bonus token (else recovered)
    committed: list[int]       # tokens committed to Redis and streamed (after the EOS / length cut)
    finish: str = ""           # "", or "stop" (EOS), "length" or "cancelled"


@dataclass
class Stats:
    prompt_tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    committed_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def add(self, step: StepResult) -> None:
        self.steps += 1
        self.draft_tokens += step.draft_tokens
        self.accepted_tokens += step.accepted
        self.bonus_tokens += step.bonus
        self.recovered_tokens += not step.bonus
        self.committed_tokens += len(step.committed)
        if self.first_token_at is None and step.committed:
            self.first_token_at = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def committed_per_step(self) -> float:
        """Accepted draft tokens + the recovered or bonus one, per step: the speedup multiplier."""
        return self.committed_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.committed_tokens / self.elapsed_s if self.committed_tokens else 0.0

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first_token_at - self.started) if self.first_token_at else 0.0


@dataclass
class Chunk:
    session_id: str
    text: str
    stats: Stats
    step: StepResult | None = None     # None: the first chunk, before any step
    finish_reason: str = ""
    offset: int = 0                    # completion tokens before this chunk's
    replayed: list[int] = field(default_factory=list)   # a resumed stream's first chunk: tokens already committed
    request: GenerationRequest | None = None            # the first chunk: what the session runs with

    @property
    def token_ids(self) -> list[int]:
        return self.step.committed if self.step is not None else self.replayed


@dataclass
class _Ahead:
    """The next step, begun during a step's commit (Decoder._propose_ahead): its span and its Propose."""

    span: object                # the next step's span (started then, ended when that step returns)
    propose: asyncio.Future     # -> what Decoder._propose returns


@dataclass
class _Stream:
    """One session's decoding state in this orchestrator."""

    req: GenerationRequest
    sampling: sampling_pb2.SamplingParams                   # encoded once, sent every step
    committed: list[int]
    fingerprints: PrefixFingerprints                        # of every committed prefix, for CacheSync
    draft: Handle
    verifier: Handle
    prefill: asyncio.Future | None = None                   # the target reading the prompt
    reading: asyncio.Future | None = None                   # a feature drafter reading it (Decoder._read)
    ahead: _Ahead | None = None                             # the next step, begun during this one's commit
    trace_parent: object = None                             # the Generate span's context: each step's parent
    steps: int = 0
    # Every replica a call for this session was sent to, answered or not: all are released at the end
    # (a call in flight when the client left may still have built a cache there).
    touched: set[tuple[str, str]] = field(default_factory=set)          # (tier, replica address)
    lease: int = 1                                          # the fencing token this orchestrator commits under
    owner: str = ""                                         # the caller that created it (auth.caller_id)
    # A drafter that reads the target's features (EAGLE): their width, and the target's features of
    # committed positions 0, 1, ... as float16 rows (the wire format). Known for every committed
    # position but the last, whose feature comes with the next Verify. 0 / empty for other drafters.
    feature_dim: int = 0
    features: bytearray = field(default_factory=bytearray)


class Decoder:
    """Runs sessions against the replica pools; one instance per orchestrator."""

    def __init__(self, sessions: SessionStore, drafts: ReplicaPool, verifiers: ReplicaPool, tokenizer,
                 eos_token_ids: set[int], draft_top_n: int, rpc_timeout_s: float,
                 rpc_timeout_s_per_1k_tokens: float = 30.0, feature_drafters: dict[str, int] | None = None,
                 verify_cost: Sequence[float] = ()):
        self.sessions, self.drafts, self.verifiers = sessions, drafts, verifiers
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.draft_top_n = draft_top_n
        self.rpc_timeout_s = rpc_timeout_s
        self.rpc_timeout_s_per_1k_tokens = rpc_timeout_s_per_1k_tokens
        # Drafters that read the target's features (DrafterInfo.uses_target_features) -> feature_dim.
        self.feature_drafters = feature_drafters or {}
        # The verifier pool's measured cost of a Verify of k draft tokens (orchestrator/tree_cut.py); empty:
        # not measured (older replicas), and then no cut is sent.
        self.verify_cost = list(verify_cost)

    async def run(self, req: GenerationRequest) -> AsyncIterator[Chunk]:
        """A new session: steps until EOS, a stop string, max_new_tokens or a cancel; one chunk per step."""
        owner = auth.caller_id()
        if self.verify_cost:
            req = dataclasses.replace(req, tree_min_confidence=tree_min_confidence(self.verify_cost, req.k))
        await self.sessions.create(req.session_id, req.prompt_ids, _params_record(req), req.seed, owner=owner)
        s = _Stream(req, wire.sampling_to_pb(req.params), list(req.prompt_ids), PrefixFingerprints(req.prompt_ids),
                    Handle(cache_id=req.session_id), Handle(cache_id=req.session_id), owner=owner,
                    feature_dim=self._feature_dim(req))
        # The target reads the prompt during the first Propose (a feature drafter's waits for its features).
        s.prefill = asyncio.ensure_future(self._prefill(s))
        async for chunk in self._drive(s, offset=0):
            yield chunk

    async def resume(self, session_id: str, offset: int) -> AsyncIterator[Chunk]:
        """Continue a session from its Redis record (its stream was lost): first the committed tokens
        past `offset`, then new steps. Draws depend only on (seed, position), so nothing changes.
        A session that already ended (kept `finished_ttl_s`) replays its tail and ends the same way."""
        record = await self.sessions.get(session_id)
        if record is None:
            raise NotFound(f"no session {session_id!r} to resume (finished, expired or never started)")
        if record.owner != auth.caller_id():
            raise PermissionDenied(f"session {session_id} belongs to another caller")
        committed = record.tokens[record.prompt_len:]
        if not 0 <= offset <= len(committed):
            raise InvalidArgument("resume_offset", f"must be in [0, {len(committed)}] (the tokens committed so far), "
                                                   f"got {offset}")
        if record.status != "finished":
            lease = await self.sessions.take_lease(session_id)   # fences off whoever drove it before
            # Read it again under the lease: the old driver may have committed a step between the read
            # above and the lease, and a stream built from the older record would fail its first commit.
            record = await self.sessions.get(session_id) if lease else None
            if record is None:
                raise NotFound(f"no session {session_id!r} to resume (finished, expired or never started)")
            committed = record.tokens[record.prompt_len:]
        req = _request_from_record(record)
        if record.status == "finished":   # its driver ended it and released its caches: only the tail is left
            text = TextStream(self.tokenizer, req.stop)
            text.update(committed[:offset], final=False)
            yield Chunk(session_id, text.update(committed, final=True), Stats(prompt_tokens=len(req.prompt_ids)),
                        finish_reason=record.finish_reason, offset=offset, replayed=committed[offset:], request=req)
            return
        s = _Stream(req, wire.sampling_to_pb(req.params), list(record.tokens), PrefixFingerprints(record.tokens),
                    record.draft_handle, record.verifier_handle, steps=record.step, lease=lease, owner=record.owner,
                    feature_dim=self._feature_dim(req))
        # Its driver may have died after committing the last step, before ending it: then nothing is left
        # to decode (a step past an EOS would invent tokens), only the caches it left to release.
        s.touched = {(tier, h.replica) for tier, h in (("draft", s.draft), ("verifier", s.verifier)) if h.replica}
        done = self._ended(req, committed)
        if s.feature_dim and not done:
            # Features are not in Redis: the target reads every committed token again, which also
            # rebuilds its cache, and the first Propose waits for their features.
            s.prefill = asyncio.ensure_future(self._prefill(s))
        log.info("resuming session at %d of %d committed tokens (lease %d%s)", offset, len(committed), lease,
                 f", already ended: {done}" if done else "")
        async for chunk in self._drive(s, offset, done):
            yield chunk

    def _feature_dim(self, req: GenerationRequest) -> int:
        """The width of the target's features when this session's drafter reads them (0: it never drafts)."""
        return self.feature_drafters.get(req.drafter, 0) if req.k else 0

    def _ended(self, req: GenerationRequest, generated: list[int]) -> str:
        """How a session with these committed tokens has already ended: "stop", "length" or ""."""
        if generated and generated[-1] in self.eos_token_ids:
            return "stop"
        text = TextStream(self.tokenizer, req.stop)
        text.update(generated, final=True)
        if text.stopped:
            return "stop"
        return "length" if len(generated) >= req.max_new_tokens else ""

    async def _drive(self, s: _Stream, offset: int, finish: str = "") -> AsyncIterator[Chunk]:
        """The loop: a first chunk (with the committed tokens past `offset`, when resuming), then a chunk per
        step, until a step ends it (or at once: `finish`, a resumed session that had already ended)."""
        req = s.req
        stats = Stats(prompt_tokens=len(req.prompt_ids))
        text = TextStream(self.tokenizer, req.stop)
        telemetry.bind_session(req.session_id)       # on the Generate span and in log records
        telemetry.record_request(req.drafter, len(req.prompt_ids))
        generated = s.committed[len(req.prompt_ids):]
        text.update(generated[:offset], final=False)  # what the client already holds
        replay = text.update(generated, final=bool(finish))
        ended = ""
        fenced = keep_record = False
        s.trace_parent = otel_context.get_current()
        try:
            yield Chunk(req.session_id, replay, stats, finish_reason=finish, offset=offset,
                        replayed=generated[offset:], request=req)
            while not finish:
                started = time.perf_counter()
                # The span ends before the yield: a step's children are Propose, Verify, accept and commit. A
                # step whose Propose was sent during the last step's commit began then, and so did its span.
                span = s.ahead.span if s.ahead is not None else telemetry.tracer().start_span(telemetry.SPAN_STEP)
                with trace.use_span(span, end_on_exit=True):
                    before = len(s.committed) - len(req.prompt_ids)
                    step = await self.step(s)
                    _describe(span, s.steps, step)
                stats.add(step)
                finish = step.finish
                delta = text.update(s.committed[len(req.prompt_ids):], final=bool(finish))
                if text.stopped and finish != "cancelled":
                    finish = "stop"
                first = stats.first_token_at is not None and stats.committed_tokens == len(step.committed) > 0
                telemetry.record_step(req.drafter, step.draft_tokens, step.accepted, step.bonus, len(step.committed),
                                      time.perf_counter() - started, stats.time_to_first_token_s if first else None)
                yield Chunk(req.session_id, delta, stats, step, finish, offset=before)
            ended = finish
        except Fenced:
            fenced = True   # the new driver holds the record and the caches now: leave them be
            raise
        except ServiceError as error:
            # A tier or Redis down past its retry window: the client may resume once it is back, so the
            # record stays (until its TTL); the caches go, they are rebuilt on resume.
            keep_record = error.code == grpc.StatusCode.UNAVAILABLE
            raise
        finally:
            self._drop_ahead(s)
            for task in (s.prefill, s.reading):   # the loop ended (or failed) before using it
                _cancel(task)
            telemetry.record_request_end(req.drafter, ended, stats.elapsed_s,
                                         stats.time_to_first_token_s if stats.first_token_at else None,
                                         stats.committed_tokens)
            # Counts only: prompts and outputs are never logged.
            log.info("session %s (%s): %d tokens in %d steps, %d of %d draft tokens accepted, %.2f s",
                     "handed over" if fenced else "finished", ended or "aborted", stats.committed_tokens,
                     stats.steps, stats.accepted_tokens, stats.draft_tokens, stats.elapsed_s)
            if not fenced:
                await asyncio.shield(self._release(req.session_id, s.touched, keep_record, ended, s.lease))

    async def step(self, s: _Stream) -> StepResult:
        """Propose k draft tokens, verify them in one target pass, accept a prefix, commit."""
        req, start = s.req, len(s.committed)
        generated = start - len(req.prompt_ids)
        k = _draft_budget(s)
        if s.feature_dim and s.prefill is not None and k > 0:
            # A feature drafter must read the whole prompt, with the target's features of it, before it can
            # draft. Rather than make the first token wait for that read, a draft and a (k + 1)-token Verify,
            # a session's first step verifies no draft tokens while the draft reads the prompt beside it: the
            # first token comes when target-only's would, and the next Propose, which waits for the read,
            # syncs one token. A resumed session past its first step reads, then drafts, now:
            # a plain step samples with other draws than a drafted one, so drafting where the stream it
            # continues did keeps its schedule, and with it its sampled tokens, by construction.
            s.verifier, s.prefill = await s.prefill, None
            if generated == 0:
                s.reading, k = asyncio.ensure_future(self._read(s, start)), 0
            else:
                await self._read(s, start)
        if s.ahead is not None:   # sent during the last step's commit (below), for this k
            ahead, s.ahead = s.ahead.propose, None
            proposals, draft_len, parents = await ahead
        else:
            proposals, draft_len, parents = await self._propose_after_read(s, k) if k > 0 else ([], 0, [])
        if s.prefill is not None:
            s.verifier, s.prefill = await s.prefill, None
        scores, verifier_len, fed = await self._verify(s, proposals, parents)
        tokens = [p.token_id for p in proposals]
        with telemetry.tracer().start_as_current_span(telemetry.SPAN_ACCEPT):
            result = accept_tree(tokens, parents, scores, req.seed, start) if parents \
                else accept(tokens, wire.draft_probs(proposals), scores, req.seed, start)
        # The replicas also hold the draft tokens; only the accepted prefix of them stays valid. Of a tree,
        # the verifier holds the first chain (nodes 0, 1, ...) and keeps the rest of the accepted path itself
        # when the next sync continues it (specmesh.kv.KVSession._place_tree).
        path = result.path if parents else range(result.accepted)
        on_chain = next((j for j, node in enumerate(path) if node != j), len(path))
        s.verifier.cached_len = min(verifier_len, start + on_chain)
        if proposals:
            # A feature drafter computed its accepted draft positions from its own stand-in features:
            # they are synced again (with the target's real ones), so its handle stays at the start.
            s.draft.cached_len = start if s.feature_dim or parents else min(draft_len, start + result.accepted)
        committed, finish = self._cut(result.tokens, generated, req.max_new_tokens)
        if s.feature_dim:   # the fed committed tokens and the accepted drafts; never a rejected one
            first, rows = fed
            if parents:
                rows = _path_rows(rows, 2 * s.feature_dim, len(proposals), result.path)
            self._learn_features(s, first, rows, upto=start + len(committed) - 1)
        s.steps += 1
        # The next step's Propose needs only the tokens committed now, not Redis's answer: sent before the
        # commit, the draft works while Redis commits and the stream writes this step (about 0.7 ms of a
        # 45 ms step on the build machine). Redis stays the record: a cancelled commit takes these tokens
        # back out and drops that Propose; a failed one ends the session, which drops it too.
        s.committed += committed
        s.fingerprints.extend(committed)
        if not finish:
            self._propose_ahead(s)
        with telemetry.tracer().start_as_current_span(telemetry.SPAN_COMMIT):
            try:
                status = await self.sessions.commit(req.session_id, start, committed, s.steps, s.draft, s.verifier,
                                                    s.lease)
            except SessionLost:   # Redis came back empty: this stream holds everything the record held
                log.warning("session record lost (Redis restarted without its data?); writing it again")
                await self.sessions.create(req.session_id, s.committed[:start], _params_record(req), req.seed,
                                           prompt_len=len(req.prompt_ids), lease=s.lease, owner=s.owner)
                status = await self.sessions.commit(req.session_id, start, committed, s.steps, s.draft, s.verifier,
                                                    s.lease)
        if status == "cancelled":   # Redis kept nothing of this step: neither does the client
            self._take_back(s, start)
            committed, finish = [], "cancelled"
        return StepResult(k, len(proposals), result.accepted, result.bonus, committed, finish)

    def _propose_ahead(self, s: _Stream) -> None:
        """Begin the next step now, with its Propose, when it drafts at all (step() awaits the Propose)."""
        k = _draft_budget(s)
        if k <= 0 or s.prefill is not None:
            return

        span = telemetry.tracer().start_span(telemetry.SPAN_STEP, context=s.trace_parent)
        with trace.use_span(span):   # the Propose's spans go under the step it serves
            s.ahead = _Ahead(span, asyncio.ensure_future(self._propose_after_read(s, k)))

    @classmethod
    def _take_back(cls, s: _Stream, start: int) -> None:
        """Undo a step's tokens that Redis did not keep, and the next step begun on them."""
        del s.committed[start:]
        s.fingerprints.truncate(start)
        cls._drop_ahead(s)

    @staticmethod
    def _drop_ahead(s: _Stream) -> None:
        """End the next step begun during a commit, unused: its span, and its Propose."""
        if s.ahead is not None:
            s.ahead.span.end()
            _cancel(s.ahead.propose)
            s.ahead = None

    def _cut(self, tokens: list[int], generated: int, max_new: int) -> tuple[list[int], str]:
        """Stop at the first EOS (kept in the ids) or at max_new_tokens."""
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                return tokens[:i + 1], "stop"
        tokens = tokens[:max_new - generated]
        return tokens, "length" if generated + len(tokens) >= max_new else ""

    async def _prefill(self, s: _Stream) -> Handle:
        prompt = list(s.committed)

        async def rpc(replica, start):
            s.touched.add(("verifier", replica.address))
            return await replica.stub.Prefill(
                verifier_pb2.PrefillRequest(session_id=s.req.session_id, token_ids=prompt,
                                            return_features=bool(s.feature_dim)),
                timeout=self._deadline(len(prompt)))

        replica, reply = await self.verifiers.call(Handle(), prompt, rpc)
        if s.feature_dim:
            self._learn_features(s, 0, reply.features, upto=len(prompt))
        return Handle(replica.address, s.req.session_id, reply.cached_len)

    @staticmethod
    def _learn_features(s: _Stream, first: int, rows: bytes, upto: int) -> None:
        """Keep the target's features from `rows` (positions first, first + 1, ...) for the positions
        not known yet, below `upto`; what is known is never overwritten."""
        size = 2 * s.feature_dim
        known = len(s.features) // size
        if first > known:   # the verifier fed from past what is known: a gap no later call fills
            raise ServiceError(f"verifier returned features from position {first}; only {known} are known")
        take = max(0, min(upto - first, len(rows) // size) - (known - first))
        s.features += rows[(known - first) * size:(known - first + take) * size]

    @staticmethod
    def _draft_features(s: _Stream, start: int) -> bytes:
        """ProposeRequest.features for a sync from `start`: the feature before each synced position."""
        size = 2 * s.feature_dim
        zeros = bytes(size) if start == 0 else b""
        return zeros + bytes(s.features[max(0, start - 1) * size:(len(s.committed) - 1) * size])

    async def _read(self, s: _Stream, start: int) -> None:
        """A Propose of 0: the draft syncs the `start` committed tokens and reads them now."""
        await self._propose(s, 0)
        s.draft.cached_len = start   # it fed every one with the target's features

    async def _propose_after_read(self, s: _Stream, k: int) -> tuple[Sequence[draft_pb2.DraftProposal], int, list[int]]:
        """_propose, once a session's first step's read of the prompt (Decoder._read) is done."""
        if s.reading is not None:
            reading, s.reading = s.reading, None
            await reading
        return await self._propose(s, k)

    async def _propose(self, s: _Stream, k: int) -> tuple[Sequence[draft_pb2.DraftProposal], int, list[int]]:
        """The draft's proposals, as messages (they go to the verifier as they are), its cached length, and
        the parents of a draft tree (empty for a chain)."""
        cut = {} if s.req.tree_min_confidence is None else {"tree_min_confidence": s.req.tree_min_confidence}

        async def rpc(replica, start):
            s.touched.add(("draft", replica.address))
            return await replica.stub.Propose(draft_pb2.ProposeRequest(
                session_id=s.req.session_id, sync=self._sync(s, start), k=k, drafter=s.req.drafter,
                sampling=s.sampling, seed=s.req.seed, top_n=self.draft_top_n,
                features=self._draft_features(s, start) if s.feature_dim else b"", **cut),
                timeout=self._deadline(len(s.committed) - start))

        replica, reply = await self.drafts.call(s.draft, s.committed, rpc)
        s.draft = Handle(replica.address, s.req.session_id, s.draft.cached_len)
        return reply.proposals, reply.cached_len, list(reply.parents)

    async def _verify(self, s: _Stream, proposals: Sequence[draft_pb2.DraftProposal], parents: list[int]
                      ) -> tuple[Scores | TreeScores, int, tuple[int, bytes]]:
        """The scores, the verifier's cached length, and (features_start, features) when the drafter reads them."""
        async def rpc(replica, start):
            s.touched.add(("verifier", replica.address))
            return await replica.stub.Verify(verifier_pb2.VerifyRequest(
                session_id=s.req.session_id, sync=self._sync(s, start), proposals=proposals,
                sampling=s.sampling, seed=s.req.seed, return_features=bool(s.feature_dim), parents=parents),
                timeout=self._deadline(len(s.committed) - start))

        replica, reply = await self.verifiers.call(s.verifier, s.committed, rpc)
        s.verifier = Handle(replica.address, s.req.session_id, s.verifier.cached_len)
        if parents and len(reply.end_tokens) != len(proposals) + 1:
            # A verifier from before draft trees ignores `parents` and scores a chain.
            raise ServiceError(f"verifier {replica.address} did not score the draft tree (no end_tokens): upgrade "
                               "the verifier tier, or set tree_branch=1 on the draft tier")
        scores = TreeScores(list(reply.target_probs), list(reply.end_tokens)) if parents \
            else Scores(list(reply.target_probs), list(reply.recovered_tokens), reply.bonus_token)
        return scores, reply.cached_len, (reply.features_start, reply.features)

    def _deadline(self, tokens_sent: int) -> float:
        return self.rpc_timeout_s + self.rpc_timeout_s_per_1k_tokens * tokens_sent / 1000

    @staticmethod
    def _sync(s: _Stream, start: int) -> cache_pb2.CacheSync:
        """Bring a replica from `start` committed tokens to all of them, proving the first `start`."""
        return cache_pb2.CacheSync(start=start, token_ids=s.committed[start:],
                                   prefix_fingerprint=s.fingerprints.at(start))

    async def _release(self, session_id: str, touched: set[tuple[str, str]], keep_record: bool = False,
                       finish: str = "", lease: int = 1) -> None:
        """Free the session's caches on every replica it reached, and its Redis record: kept a while as
        finished when the session ended (a client that lost the last chunks resumes and gets them),
        deleted when it was abandoned. A failure here only costs memory until the replica's idle TTL or
        LRU eviction, or Redis's TTL."""
        request = cache_pb2.ReleaseRequest(session_id=session_id)
        calls = ([] if keep_record else [self.sessions.finish(session_id, lease, finish)] if finish
                 else [self.sessions.release(session_id)])
        for pool in (self.drafts, self.verifiers):
            for replica in pool.replicas:
                if (pool.tier, replica.address) in touched:
                    calls.append(replica.stub.Release(request, timeout=5))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.warning("release of session %s incomplete: %s", session_id, outcome)


def _cancel(task: asyncio.Future | None) -> None:
    if task is not None:
        task.cancel()
        if task.done() and not task.cancelled():
            task.exception()   # retrieved: asyncio would otherwise log it as lost


def _draft_budget(s: _Stream) -> int:
    """k for the session's next step: never draft past max_new_tokens (k accepted plus a bonus is k + 1)."""
    return min(s.req.k, s.req.max_new_tokens - (len(s.committed) - len(s.req.prompt_ids)) - 1)


def _path_rows(rows: bytes, size: int, nodes: int, path: Sequence[int]) -> bytes:
    """A tree's Verify features hold a row for each fed committed token, then one for every node: keep the
    committed tokens' and the accepted path's, in path order (rows of `size` bytes)."""
    committed = len(rows) // size - nodes
    return rows[:committed * size] + b"".join(rows[(committed + j) * size:(committed + j + 1) * size] for j in path)


def _describe(span, number: int, step: StepResult) -> None:
    if span.is_recording():
        span.set_attributes({telemetry.ATTR_STEP: number, telemetry.ATTR_K: step.k,
                             telemetry.ATTR_DRAFT_TOKENS: step.draft_tokens,
                             telemetry.ATTR_ACCEPTED_TOKENS: step.accepted, telemetry.ATTR_BONUS: step.bonus,
                             telemetry.ATTR_COMMITTED_TOKENS: len(step.committed)})


def _request_from_record(record) -> GenerationRequest:
    p = record.params
    return GenerationRequest(
        session_id=record.session_id, prompt_ids=record.tokens[:record.prompt_len],
        max_new_tokens=p["max_new_tokens"], params=SamplingParams(p["temperature"], p["top_k"], p["top_p"]),
        seed=record.seed, stop=tuple(p["stop"]), k=p["k"], drafter=p["drafter"],
        tree_min_confidence=p.get("tree_min_confidence"))   # absent from an older orchestrator's records


def _params_record(req: GenerationRequest) -> dict:
    return {"temperature": req.params.temperature, "top_k": req.params.top_k, "top_p": req.params.top_p,
            "k": req.k, "drafter": req.drafter, "max_new_tokens": req.max_new_tokens, "stop": list(req.stop),
            "tree_min_confidence": req.tree_min_confidence}
