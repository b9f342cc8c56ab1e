"""Bounds on what any caller may send, shared by every service and client.

A session id reaches logs, Redis keys and metrics labels, so it is held to a
short, printable charset: a newline can never forge a log line, and a 1 MB id
is refused before anything stores it. Message sizes are capped on every gRPC
server and channel, so an oversized message is refused by gRPC itself with
RESOURCE_EXHAUSTED before a byte of it is parsed.
"""
from __future__ import annotations

import re

from specmesh.errors import InvalidArgument

MAX_SESSION_ID_CHARS = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,%d}" % MAX_SESSION_ID_CHARS)

# A message carrying a whole context of token ids (a cache-miss resend) takes about 5 bytes a token.
# 16 MiB, not gRPC's 4: the target's features for a whole context travel in one Prefill reply (and a
# draft resend) for an EAGLE draft: 2 bytes x hidden size a token, 9.4 MB for SmolLM2's 8,192 tokens.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def check_session_id(session_id: str, field: str = "session_id") -> None:
    """1..128 characters of [A-Za-z0-9._:-] (a UUID, a ULID, "tenant:request-7" all fit)."""
    if not _SESSION_ID.fullmatch(session_id):
        problem = "must not be empty" if not session_id else (
            f"must be 1 to {MAX_SESSION_ID_CHARS} characters of A-Z a-z 0-9 . _ : -, "
            f"got {len(session_id)} characters starting {shown(session_id)}")
        raise InvalidArgument(field, problem)


def shown(value: str, limit: int = 40) -> str:
    """A caller's string quoted for an error message: escaped, and cut so an echo stays small."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    """gRPC options capping received and sent messages, for a server or a channel."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
