"""Errors in OpenAI's shape, and the HTTP status for each gRPC status.

Every error a client sees is {"error": {"message", "type", "param", "code"}},
the body the openai SDKs parse into their own exception types
(BadRequestError, NotFoundError, RateLimitError, ...).
"""
from __future__ import annotations

import grpc

# gRPC status -> (HTTP status, OpenAI error type, code). The gateway's own
# failures are the only 500s; an upstream INTERNAL is the upstream's (502).
_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error", None),
    grpc.StatusCode.ABORTED: (409, "conflict_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
_UPSTREAM_FAILURE = (502, "server_error", "upstream_error")   # INTERNAL, UNKNOWN, DATA_LOSS

# The orchestrator names proto fields; clients know OpenAI's names.
_FIELD_NAMES = {
    "max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "text": "prompt",
    "tokens.token_ids": "prompt",
    "chat": "messages",
    "chat.messages": "messages",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def openai_field(proto_field: str, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> str:
    """The request field a client sent for the proto field an error names."""
    if proto_field.startswith("chat.messages["):   # chat.messages[2].role -> messages[2].role
        return proto_field[len("chat."):]
    name = _FIELD_NAMES.get(proto_field, proto_field)
    if name == "prompt":
        return prompt_field
    if name == "max_tokens":
        return max_tokens_field
    return name


def from_grpc(error: grpc.aio.AioRpcError, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens"
              ) -> APIError:
    """Translate an orchestrator status; INVALID_ARGUMENT's "field: problem" gives `param`."""
    code = error.code()
    status, kind, openai_code = _BY_CODE.get(code, _UPSTREAM_FAILURE)
    message = error.details() or code.name
    param = None
    if code == grpc.StatusCode.INVALID_ARGUMENT and ": " in message:
        field, problem = message.split(": ", 1)
        if field and " " not in field:
            param = openai_field(field, prompt_field, max_tokens_field)
            message = f"{param}: {problem}"
    return APIError(status, message, kind, param, openai_code)


def validation_param(loc: tuple) -> str | None:
    """pydantic's error location ("body", "messages", 0, "role") as OpenAI's param ("messages[0].role")."""
    parts = [p for p in loc if p != "body"]
    # Union members add their type names ("str", "list[str]"): not part of the client's field path.
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "function-after")):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None
