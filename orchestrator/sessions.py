"""Session state in Redis: what it takes to rebuild any cache, and where the caches are.

Per session, two keys sharing a hash tag (so Redis Cluster keeps them on one slot):

    specmesh:session:{ID}   hash: prompt_len, params (JSON), seed, step, status,
                            draft_handle, verifier_handle (JSON), lease (the fencing
                            token of whoever drives it), owner (who may cancel or resume),
                            finish_reason (once finished)
    specmesh:tokens:{ID}    string: committed token ids, int32 little-endian

Every change goes through a Lua script, so it is atomic: `commit` appends a
step's tokens only if the committed length is what the caller last saw, and
reports a cancellation set meanwhile by `cancel` (from any orchestrator
replica) in the same round trip. Both keys carry the session TTL, refreshed on
every commit, so an abandoned session disappears on its own.

A session that ended (EOS, a stop string, its length, a cancel) is kept a short
while as "finished" with its finish reason (`finish`, `finished_ttl_s`): a
client that lost the last chunks resumes and gets them, and the same end,
instead of NOT_FOUND. Its id may be used again for a new session meanwhile.
"""
from __future__ import annotations

import asyncio
import functools
import json
import struct
from dataclasses import asdict, dataclass

import grpc
import redis.asyncio as redis
from redis.asyncio.retry import Retry   # the asyncio one: redis.retry.Retry would not await the command
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specmesh.errors import AlreadyExists, NotFound, PermissionDenied, ServiceError, Unavailable

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'status') ~= 'finished' then return 0 end
  redis.call('DEL', KEYS[1], KEYS[2])   -- a finished session's id may start a new one
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SET', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""

# ARGV: ttl, expected committed length, new token bytes, step, draft handle, verifier handle, lease
_COMMIT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[7] then return -4 end
if redis.call('HGET', KEYS[1], 'status') == 'cancelled' then return -2 end
if redis.call('STRLEN', KEYS[2]) ~= 4 * tonumber(ARGV[2]) then return -3 end
local length = redis.call('APPEND', KEYS[2], ARGV[3]) / 4
redis.call('HSET', KEYS[1], 'step', ARGV[4], 'draft_handle', ARGV[5], 'verifier_handle', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return length
"""

# The fencing token: whoever drives the session holds the current value; taking the lease
# increments it, so the previous driver's next commit is refused.
_TAKE_LEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HINCRBY', KEYS[1], 'lease', 1)
"""

# ARGV: the caller. Only the session's owner (the caller that created it) may cancel it.
_CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'status') == 'finished' then return 0 end
if (redis.call('HGET', KEYS[1], 'owner') or '') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
return 1
"""

# ARGV: ttl, lease, finish reason. Only the driver (its lease) ends a session; the record stays
# `ttl` seconds, for a resume that lost the last chunks.
_FINISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reason', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""


@dataclass
class Handle:
    """Where a session's cache lives on one tier: replica, cache id, and how many
    committed tokens that cache holds (the next call's CacheSync.start)."""

    replica: str = ""
    cache_id: str = ""
    cached_len: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Handle":
        return cls(**json.loads(text))


@dataclass
class SessionRecord:
    session_id: str
    tokens: list[int]
    prompt_len: int
    params: dict
    seed: int
    step: int
    status: str
    draft_handle: Handle
    verifier_handle: Handle
    ttl_s: int
    owner: str = ""          # the caller that created it (auth.caller_id), "" without authentication
    finish_reason: str = ""  # set once finished (status "finished"): how its stream ended


class SessionLost(NotFound):
    """The record vanished while its stream ran: Redis restarted without its data (nothing
    else deletes a running session's record). Its orchestrator can write it again."""


def _unavailable_when_down(method):
    """Redis unreachable past the client's retries: UNAVAILABLE, naming no internal address."""
    @functools.wraps(method)
    async def wrapped(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError):
            raise Unavailable("the session store (Redis) is unreachable; retry shortly") from None
    return wrapped


class Fenced(ServiceError):
    """Another orchestrator took the session over (a resume): this one must stop driving it."""

    code = grpc.StatusCode.ABORTED


class CommitConflict(ServiceError):
    """Another writer changed the session: two streams must not drive one session."""

    code = grpc.StatusCode.ABORTED


def pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


class SessionStore:
    def __init__(self, client: redis.Redis, ttl_s: int, prefix: str = "specmesh", finished_ttl_s: int = 300):
        self.client = client
        self.ttl_s = ttl_s
        self.finished_ttl_s = finished_ttl_s
        self.prefix = prefix
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)
        self._cancel = client.register_script(_CANCEL)
        self._take_lease = client.register_script(_TAKE_LEASE)
        self._finish = client.register_script(_FINISH)

    @classmethod
    def from_url(cls, url: str, ttl_s: int, password: str | None = None, retry_s: float = 5.0,
                 finished_ttl_s: int = 300) -> "SessionStore":
        """A password in the URL wins over `password` (REDIS_PASSWORD, kept in a Secret apart from the URL).

        redis-py retries a command on a lost connection with exponential backoff for about
        `retry_s`: a Redis blip (a restart, a failover) costs latency, not the streams in flight.
        """
        retries = max(1, round(retry_s / 0.5) + 2)   # waits 0.1, 0.2, 0.4, then 0.5 s each: about retry_s
        return cls(redis.Redis.from_url(
            url, password=password or None, socket_connect_timeout=1.0, socket_timeout=5.0,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError]), ttl_s, finished_ttl_s=finished_ttl_s)

    def keys(self, session_id: str) -> list[str]:
        return [f"{self.prefix}:session:{{{session_id}}}", f"{self.prefix}:tokens:{{{session_id}}}"]

    @_unavailable_when_down
    async def create(self, session_id: str, prompt: list[int], params: dict, seed: int,
                     prompt_len: int | None = None, lease: int = 1, owner: str = "") -> None:
        """A new record holding `prompt` as its tokens (a restored one: every committed token so far)."""
        fields = {"prompt_len": len(prompt) if prompt_len is None else prompt_len, "params": json.dumps(params), "seed": seed, "step": 0,
                  "status": "running", "draft_handle": Handle().to_json(), "verifier_handle": Handle().to_json(),
                  "lease": lease, "owner": owner}
        flat = [item for pair in fields.items() for item in pair]
        if not await self._create(keys=self.keys(session_id), args=[self.ttl_s, pack(prompt), *flat]):
            raise AlreadyExists(f"session {session_id} already exists")

    @_unavailable_when_down
    async def commit(self, session_id: str, expected_len: int, new_tokens: list[int], step: int,
                     draft: Handle, verifier: Handle, lease: int = 1) -> str:
        """Append a step's committed tokens if `lease` is still the session's; "running" or "cancelled"."""
        result = await self._commit(keys=self.keys(session_id),
                                    args=[self.ttl_s, expected_len, pack(new_tokens), step,
                                          draft.to_json(), verifier.to_json(), lease])
        if result == -4:
            raise Fenced(f"session {session_id} was taken over by another orchestrator (resumed)")
        if result == -1:
            raise SessionLost(f"session {session_id} expired or was released")
        if result == -3:
            raise CommitConflict(f"session {session_id} was changed by another writer")
        return "cancelled" if result == -2 else "running"

    @_unavailable_when_down
    async def take_lease(self, session_id: str) -> int:
        """Become the session's driver: the new fencing token, 0 when there is no such session."""
        return int(await self._take_lease(keys=self.keys(session_id)))

    @_unavailable_when_down
    async def cancel(self, session_id: str, caller: str = "") -> bool:
        """Mark the session cancelled; False when there is none. PERMISSION_DENIED for another caller's."""
        result = await self._cancel(keys=self.keys(session_id), args=[caller])
        if result == -1:
            raise PermissionDenied(f"session {session_id} belongs to another caller")
        return bool(result)

    @_unavailable_when_down
    async def finish(self, session_id: str, lease: int, finish_reason: str) -> bool:
        """Mark the session finished; it stays `finished_ttl_s` (0: deleted now). False when another
        orchestrator holds it now, or it is gone."""
        if self.finished_ttl_s <= 0:
            return await self.release(session_id)
        return await self._finish(keys=self.keys(session_id),
                                  args=[self.finished_ttl_s, lease, finish_reason]) == 1

    @_unavailable_when_down
    async def get(self, session_id: str) -> SessionRecord | None:
        key, tokens_key = self.keys(session_id)
        async with self.client.pipeline(transaction=True) as pipe:
            fields, tokens, ttl = await pipe.hgetall(key).get(tokens_key).ttl(key).execute()
        if not fields:
            return None
        f = {k.decode(): v for k, v in fields.items()}
        return SessionRecord(session_id=session_id, tokens=unpack(tokens or b""), prompt_len=int(f["prompt_len"]),
                             params=json.loads(f["params"]), seed=int(f["seed"]), step=int(f["step"]),
                             status=f["status"].decode(), draft_handle=Handle.from_json(f["draft_handle"]),
                             verifier_handle=Handle.from_json(f["verifier_handle"]), ttl_s=int(ttl),
                             owner=f.get("owner", b"").decode(),
                             finish_reason=f.get("finish_reason", b"").decode())

    @_unavailable_when_down
    async def release(self, session_id: str) -> bool:
        return bool(await self.client.delete(*self.keys(session_id)))

    async def reachable(self, timeout_s: float = 1.0) -> bool:
        """One PING within `timeout_s`, without the retries (health checks must answer now)."""
        try:
            return bool(await asyncio.wait_for(self.client.ping(), timeout_s))
        except (RedisConnectionError, RedisTimeoutError, asyncio.TimeoutError, OSError):
            return False
