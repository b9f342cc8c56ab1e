"""Who may call: bearer tokens in gRPC metadata, compared in constant time.

The public API takes `authorization: Bearer <token>` from the tokens in a file
(a mounted Secret, one token per line, `#` comments), re-read when the file
changes, so a token is added or revoked without a restart. The internal APIs
(Draft, Verifier) take one shared internal token, which the orchestrator sends
on every call to them. Health checks and reflection stay open (probes). A
token never reaches a log, a span or a metric: a caller is known by the first
16 hex digits of its token's SHA-256 (`caller_id`), which is also what a
session records as its owner.
"""
from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
import time
from pathlib import Path

import grpc

# Probes, reflection, and the list of served models (the gateway's /v1/models) need no token.
_OPEN = ("/grpc.health.", "/grpc.reflection.", "/specmesh.v1.Orchestrator/ListModels")
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="")


def caller_id() -> str:
    """The authenticated caller of the current call ("" without authentication)."""
    return _caller.get()


def token_id(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def read_token(path: str) -> str:
    """The one token in a file (the internal token)."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path}: no token in it")
    return token


class TokenFile:
    """The tokens in a file, re-read when its modification time changes (checked once a second)."""

    def __init__(self, path: str):
        self.path = path
        self._mtime, self._checked, self._tokens = None, 0.0, []
        self._reload()
        if not self._tokens:
            raise ValueError(f"{path}: no tokens in it (one per line)")

    def _reload(self) -> None:
        mtime = os.stat(self.path).st_mtime_ns
        if mtime != self._mtime:
            lines = Path(self.path).read_text().splitlines()
            self._tokens = [t.encode() for t in (line.strip() for line in lines) if t and not t.startswith("#")]
            self._mtime = mtime

    def accepts(self, token: str) -> bool:
        now = time.monotonic()
        if now - self._checked > 1.0:
            self._checked = now
            try:
                self._reload()
            except OSError:   # a Secret being swapped: keep the tokens we have
                pass
        given = token.encode()
        # Compare against every token, always: no early exit tells a caller how close it came.
        return sum(hmac.compare_digest(given, t) for t in self._tokens) > 0


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without an accepted bearer token."""

    def __init__(self, accepts):
        self._accepts = accepts

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN):
            return handler
        token = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and value.startswith("Bearer "):
                token = value[len("Bearer "):].strip()
        if token and self._accepts(token):
            return _as_caller(handler, token_id(token))
        return _refusing(handler, "missing bearer token" if not token else "token not accepted")


def _as_caller(handler, caller: str):
    """The handler, run with caller_id() set."""
    def unary(behavior):
        async def wrapped(request, context):
            _caller.set(caller)
            return await behavior(request, context)
        return wrapped

    def stream(behavior):
        async def wrapped(request, context):
            _caller.set(caller)
            async for item in behavior(request, context):
                yield item
        return wrapped

    return _replace(handler, unary, stream)


def _refusing(handler, why: str):
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authentication failed: {why}")

    async def refuse_stream(request, context):
        # An async generator, as a streaming handler must be for the interceptors around it
        # (OpenTelemetry's iterates it; a plain coroutine there became UNKNOWN).
        await refuse(request, context)
        yield

    return _replace(handler, lambda _: refuse, lambda _: refuse_stream)


def _replace(handler, unary, stream):
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), handler.request_deserializer,
                                                    handler.response_serializer)
    return handler


class BearerToken(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call on a channel (the orchestrator's replica channels)."""

    def __init__(self, token: str):
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), self._metadata))

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


def server_interceptors(tokens_file: str | None = None, internal_token_file: str | None = None) -> list:
    """The public API's interceptor (tokens_file) or an internal API's (internal_token_file); [] for none."""
    if tokens_file:
        return [TokenAuthInterceptor(TokenFile(tokens_file).accepts)]
    if internal_token_file:
        token = read_token(internal_token_file).encode()
        return [TokenAuthInterceptor(lambda given: hmac.compare_digest(given.encode(), token))]
    return []
