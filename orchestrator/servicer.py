"""gRPC edge of the orchestrator: the public API. Decode, run, encode."""
from __future__ import annotations

import asyncio
import contextlib

from orchestrator.decode import Chunk, Decoder
from orchestrator.requests import Limits, tokenize_prompt, validate
from orchestrator.sessions import SessionStore
from specmesh.bounds import check_session_id
from specmesh import auth
from specmesh.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from specmesh.v1 import orchestrator_pb2, orchestrator_pb2_grpc

SERVICE_NAME = "specmesh.v1.Orchestrator"


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, sessions: SessionStore, max_active_sessions: int):
        self.sessions = sessions
        self.max_active_sessions = max_active_sessions
        self.decoder: Decoder | None = None   # set once the replicas have answered
        self.limits: Limits | None = None
        self.models: orchestrator_pb2.ListModelsResponse | None = None   # set with the decoder
        self.active = 0

    async def Generate(self, request, context):
        if self.decoder is None or self.limits is None:
            raise Unavailable("the orchestrator is still connecting to its draft and verifier replicas")
        if self.active >= self.max_active_sessions:
            raise ResourceExhausted(f"{self.active} sessions are running, the limit is {self.max_active_sessions}")
        self.active += 1   # before the first await, so concurrent calls cannot all slip under the limit
        try:
            if request.HasField("resume_offset"):
                if not request.session_id:
                    raise InvalidArgument("session_id", "resume_offset needs the session_id to resume")
                chunks = self.decoder.resume(request.session_id, request.resume_offset)
            else:
                prompt_ids = await asyncio.to_thread(tokenize_prompt, request, self.decoder.tokenizer)
                chunks = self.decoder.run(validate(request, prompt_ids, self.limits))
            # aclosing: a client that goes away still releases the session now, not at garbage collection.
            async with contextlib.aclosing(chunks) as chunks:
                async for chunk in chunks:
                    yield _chunk_to_pb(chunk)
        finally:
            self.active -= 1

    async def GenerateUnary(self, request, context):
        reply = orchestrator_pb2.GenerateResponse()
        async with contextlib.aclosing(self.Generate(request, context)) as chunks:
            async for chunk in chunks:
                reply.session_id = chunk.session_id
                reply.seed = reply.seed or chunk.seed
                reply.text += chunk.text
                reply.token_ids.extend(chunk.token_ids)
                reply.finish_reason = chunk.finish_reason
                reply.stats.CopyFrom(chunk.stats)
        return reply

    async def Cancel(self, request, context):
        check_session_id(request.session_id)
        if not await self.sessions.cancel(request.session_id, auth.caller_id()):
            raise NotFound(f"no session {request.session_id!r} (finished, expired or never started)")
        return orchestrator_pb2.CancelResponse()

    async def ListModels(self, request, context):
        if self.models is None:
            raise Unavailable("the orchestrator is still connecting to its draft and verifier replicas")
        return self.models


def _chunk_to_pb(chunk: Chunk) -> orchestrator_pb2.GenerateChunk:
    s, step = chunk.stats, chunk.step
    msg = orchestrator_pb2.GenerateChunk(
        session_id=chunk.session_id, text=chunk.text, finish_reason=chunk.finish_reason, offset=chunk.offset,
        stats=orchestrator_pb2.GenerateStats(
            steps=s.steps, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
            recovered_tokens=s.recovered_tokens, bonus_tokens=s.bonus_tokens, committed_tokens=s.committed_tokens,
            prompt_tokens=s.prompt_tokens, acceptance_rate=s.acceptance_rate, committed_per_step=s.committed_per_step,
            tokens_per_second=s.tokens_per_second, time_to_first_token_s=s.time_to_first_token_s,
            elapsed_s=s.elapsed_s))
    msg.token_ids.extend(chunk.token_ids)
    if step is not None:
        msg.step.CopyFrom(orchestrator_pb2.StepStats(draft_tokens=step.draft_tokens, accepted_tokens=step.accepted,
                                                     bonus=step.bonus, recovered=not step.bonus))
    if chunk.request is not None:
        msg.seed, msg.drafter, msg.k = chunk.request.seed, chunk.request.drafter, chunk.request.k
    return msg
