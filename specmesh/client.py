"""A small client for the public API: what `specmesh generate`, the benchmark
and the tests use, and an example for callers in other services."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import grpc

from specmesh.bounds import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from specmesh.tls import ChannelTLS, channel as tls_channel
from specmesh.v1 import orchestrator_pb2, orchestrator_pb2_grpc, sampling_pb2


def build_request(prompt: str | Sequence[int] | Sequence[Mapping[str, str]], *, chat: bool = False,
                  max_new_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                  top_p: float | None = None, seed: int | None = None, k: int | None = None, drafter: str = "",
                  stop: Sequence[str] = (),
                  session_id: str = "") -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(drafter=drafter, stop=list(stop), session_id=session_id,
                                               sampling=sampling_pb2.SamplingParams(temperature=temperature,
                                                                                    top_k=top_k))
    if isinstance(prompt, str):
        if chat:
            request.chat.messages.add(role="user", content=prompt)
        else:
            request.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):   # a conversation: [{"role": ..., "content": ...}, ...]
        for message in prompt:
            request.chat.messages.add(role=message["role"], content=message["content"])
    else:
        request.tokens.token_ids.extend(prompt)
    if top_p is not None:
        request.sampling.top_p = top_p
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if seed is not None:
        request.seed = seed
    if k is not None:
        request.k = k
    return request


@dataclass
class Completion:
    session_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    seed: int = 0
    drafter: str = ""
    k: int = 0
    stats: orchestrator_pb2.GenerateStats | None = None
    chunks: int = 0

    def add(self, chunk: orchestrator_pb2.GenerateChunk) -> None:
        if self.chunks == 0:
            self.session_id, self.seed, self.drafter, self.k = chunk.session_id, chunk.seed, chunk.drafter, chunk.k
        self.chunks += 1
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.stats = chunk.stats

    def as_dict(self) -> dict:
        s = self.stats
        return {"session_id": self.session_id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "seed": self.seed, "drafter": self.drafter, "k": self.k,
                "stats": {"steps": s.steps, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                          "committed_tokens": s.committed_tokens, "prompt_tokens": s.prompt_tokens,
                          "acceptance_rate": s.acceptance_rate, "committed_per_step": s.committed_per_step,
                          "tokens_per_second": s.tokens_per_second, "time_to_first_token_s": s.time_to_first_token_s,
                          "elapsed_s": s.elapsed_s}}


class Client:
    """The public API over one channel. `address` may name several orchestrators
    ("ipv4:10.0.0.1:50051,10.0.0.2:50051", or a DNS name with several records):
    when one dies mid-stream, the stream is resumed on another, transparently."""

    def __init__(self, address: str, resume_attempts: int = 5,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, token: str | None = None,
                 tls: ChannelTLS | None = None):
        # TLS when given the CA that signed the orchestrator's certificate (and, for mutual TLS, our own pair).
        self.channel = tls_channel(address, tls, options=message_size_options(max_message_bytes))
        # A bearer token for an orchestrator that requires one (auth_tokens_file).
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.resume_attempts = resume_attempts

    def stream(self, request: orchestrator_pb2.GenerateRequest, timeout: float | None = None) -> "Stream":
        """The chunks of one completion, resumed if the stream breaks (see Stream)."""
        return Stream(self, request, timeout)

    def generate(self, prompt, timeout: float | None = None, **kwargs) -> Completion:
        completion = Completion()
        for chunk in self.stream(build_request(prompt, **kwargs), timeout=timeout):
            completion.add(chunk)
        return completion

    def list_models(self) -> orchestrator_pb2.ListModelsResponse:
        """The target, the drafters served, and the defaults a request that names none gets."""
        return self.stub.ListModels(orchestrator_pb2.ListModelsRequest(), metadata=self.metadata)

    def cancel(self, session_id: str) -> None:
        self.stub.Cancel(orchestrator_pb2.CancelRequest(session_id=session_id), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """An iterator over a completion's chunks that survives its orchestrator.

    A stream that breaks (UNAVAILABLE: its orchestrator died, the connection dropped)
    is resumed from the tokens received so far (`resume_offset`), on whichever
    orchestrator the channel reaches: the caller sees one stream, token for token
    what an uninterrupted one gives. `cancel()` ends it (the server releases the
    session), as on a plain gRPC call.
    """

    def __init__(self, client: Client, request: orchestrator_pb2.GenerateRequest, timeout: float | None):
        if not request.session_id and not request.HasField("resume_offset"):
            request = orchestrator_pb2.GenerateRequest.FromString(request.SerializeToString())
            request.session_id = uuid.uuid4().hex   # known before the first chunk, so even that can be resumed
        self._client, self._request, self._timeout = client, request, timeout
        self._call = None
        self.resumes = 0   # how often the stream broke and was resumed (`specmesh soak` counts them)
        self._chunks = self._run()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> orchestrator_pb2.GenerateChunk:
        return next(self._chunks)

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def _run(self) -> Iterator[orchestrator_pb2.GenerateChunk]:
        request, received, attempt, broke, finished = self._request, None, 0, None, False
        while True:
            try:
                # A resume waits for an orchestrator to be reachable; a stream that never started does not
                # (nothing may be listening at all).
                self._call = self._client.stub.Generate(request, timeout=self._timeout,
                                                        wait_for_ready=attempt > 0 and received is not None,
                                                        metadata=self._client.metadata)
                for chunk in self._call:
                    received = chunk.offset + len(chunk.token_ids)
                    finished = bool(chunk.finish_reason)
                    yield chunk
                return
            except grpc.RpcError as error:
                code = error.code()
                if finished and code == grpc.StatusCode.UNAVAILABLE:
                    return   # the last chunk arrived; only the call's end was lost
                if broke is not None and code == grpc.StatusCode.NOT_FOUND:
                    if received is None and request is not self._request:
                        request = self._request   # it broke before the session was created: start it afresh
                        continue
                    raise broke from None   # nothing left to resume: what broke the stream is the answer
                # Broken before its first chunk (its orchestrator died meanwhile): one more try.
                attempts = self._client.resume_attempts
                limit = attempts if received is not None else min(1, attempts)   # resume_attempts=0: never
                if code != grpc.StatusCode.UNAVAILABLE or attempt >= limit:
                    raise
                broke = error
                attempt += 1
                self.resumes += 1
                time.sleep(min(2.0, 0.1 * 2 ** attempt))   # the channel reconnects meanwhile (to another replica)
                request = orchestrator_pb2.GenerateRequest(session_id=request.session_id,
                                                           resume_offset=received or 0)
