"""Errors that carry their gRPC status.

Engines raise these; the one interceptor in specmesh.server turns them into
statuses, so servicers stay free of try/except and each code is chosen once.
"""
from __future__ import annotations

import grpc


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """A request field is out of range; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


def check_token_ids(field: str, tokens, vocab_size: int) -> None:
    """Token ids outside the vocabulary are the caller's mistake, not an index error later."""
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(field, f"token ids must be in [0, {vocab_size}), got {bad[:5]}")


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class CacheMiss(ServiceError):
    """The replica holds fewer tokens for the session than the caller assumed.

    Not a failure of the request: the orchestrator answers it by resending the
    whole committed sequence (start = 0), which rebuilds the cache.
    """

    code = grpc.StatusCode.FAILED_PRECONDITION
    PREFIX = "cache miss"

    def __init__(self, session_id: str, held: int, start: int, why: str = ""):
        super().__init__(f"{self.PREFIX}: session {session_id} holds {held} tokens here, request starts at {start}"
                         + (f"; {why}" if why else ""))


def is_cache_miss(error: grpc.aio.AioRpcError) -> bool:
    return error.code() == grpc.StatusCode.FAILED_PRECONDITION and (error.details() or "").startswith(CacheMiss.PREFIX)
