"""Draft and verifier replicas, and calls that survive losing one.

Each tier is a pool of addresses given by configuration. A session sticks to
the replica named in its handle (its KV cache is there); a new session goes to
the replica with the fewest calls in flight. When a replica is unreachable, or
answers "cache miss" (restarted, evicted), the call is repeated with the whole
committed sequence (start = 0) on a live replica: the cache is rebuilt and,
since every random draw derives from (seed, position), the output is unchanged.
That repair is ours; waiting out a blip is gRPC's (its retry policy on each
channel, and `channel_ready` when every replica of a tier is down).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

import grpc

from specmesh.bounds import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from specmesh.errors import ServiceError, Unavailable, is_cache_miss
from specmesh.tls import ChannelTLS, aio_channel
from orchestrator.sessions import Handle

log = logging.getLogger("specmesh.orchestrator")

S = TypeVar("S")
R = TypeVar("R")

# Statuses that mean "this replica cannot help now", not "this request is bad".
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}

# gRPC's own retry policy rides out a blip on one replica (a dropped connection, a
# restart) before the call fails over to another. Every internal call is safe to
# repeat: a CacheSync crops to `start` before appending, so a retry does the same.
_CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps({"methodConfig": [{"name": [{}], "retryPolicy": {
        "maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]}}]})),
]


class RemoteError(ServiceError):
    """A draft or verifier error passed through to the client with its status."""

    def __init__(self, tier: str, error: grpc.aio.AioRpcError):
        super().__init__(f"{tier}: {error.details()}")
        self.code = error.code()


@dataclass
class Replica(Generic[S]):
    address: str
    channel: grpc.aio.Channel
    stub: S
    in_flight: int = 0
    down_until: float = 0.0


@dataclass
class ReplicaPool(Generic[S]):
    tier: str
    replicas: list[Replica[S]]
    cooldown_s: float = 2.0
    # How long a call keeps trying when every replica fails (a rolling restart, a pod rescheduled).
    retry_s: float = 20.0
    # How a replica's channel is (re)made: kept so the channels can be remade when TLS files rotate.
    make_channel: Callable[[str], grpc.aio.Channel] | None = None
    stub_cls: Callable[[grpc.aio.Channel], S] | None = None
    _by_address: dict[str, Replica[S]] = field(init=False)

    def __post_init__(self):
        self._by_address = {r.address: r for r in self.replicas}

    @classmethod
    def connect(cls, tier: str, addresses: Sequence[str], stub_cls: Callable[[grpc.aio.Channel], S],
                interceptors=(), retry_s: float = 20.0,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ChannelTLS | None = None
                ) -> "ReplicaPool[S]":
        if not addresses:
            raise ValueError(f"no {tier} replica addresses configured")
        options = [*_CHANNEL_OPTIONS, *message_size_options(max_message_bytes)]

        def make_channel(address: str) -> grpc.aio.Channel:
            return aio_channel(address, tls, options=options, interceptors=list(interceptors))

        replicas = []
        for address in addresses:
            channel = make_channel(address)
            replicas.append(Replica(address, channel, stub_cls(channel)))
        return cls(tier, replicas, retry_s=retry_s, make_channel=make_channel, stub_cls=stub_cls)

    def reconnect(self, grace_s: float) -> None:
        """A new channel for every replica (fresh TLS credentials after a certificate rotated).
        Calls in flight finish on the old channels, which close after `grace_s`."""
        for replica in self.replicas:
            old = replica.channel
            replica.channel = self.make_channel(replica.address)
            replica.stub = self.stub_cls(replica.channel)
            asyncio.ensure_future(old.close(grace=grace_s))

    def pick(self, preferred: str = "", exclude: set[str] = frozenset()) -> Replica[S] | None:
        """The preferred replica if it is up, else the least busy one that is up; None when all are excluded."""
        candidates = [r for r in self.replicas if r.address not in exclude]
        if not candidates:
            return None
        now = time.monotonic()
        # A replica marked down is skipped while others are up; when all are down, the one
        # that went down first is tried again.
        live = [r for r in candidates if r.down_until <= now] or [min(candidates, key=lambda r: r.down_until)]
        for r in live:
            if r.address == preferred:
                return r
        return min(live, key=lambda r: r.in_flight)

    def mark_down(self, replica: Replica[S]) -> None:
        replica.down_until = time.monotonic() + self.cooldown_s

    async def call(self, handle: Handle, committed: Sequence[int],
                   rpc: Callable[[Replica[S], int], Awaitable[R]]) -> tuple[Replica[S], R]:
        """Run `rpc(replica, start)` on the handle's replica, repairing on failure.

        `rpc` sends committed[start:] as the cache sync. Returns the replica that
        answered; the caller updates the handle from the reply.
        """
        preferred, start, failed = handle.replica, handle.cached_len, set()
        deadline = time.monotonic() + self.retry_s
        while True:
            replica = self.pick(preferred, failed)
            if replica is None:   # every replica failed once: wait for one to come back
                replica = await self._first_ready(deadline)
                failed.clear()
            if replica.address != handle.replica:
                start = 0
            replica.in_flight += 1
            try:
                return replica, await rpc(replica, start)
            except grpc.aio.AioRpcError as error:
                if is_cache_miss(error):
                    log.info("%s %s: cache miss, re-sending %d tokens", self.tier, replica.address, len(committed))
                    preferred, start = replica.address, 0
                    handle = Handle(replica.address, handle.cache_id, 0)
                    continue
                if error.code() not in _RETRYABLE:
                    raise RemoteError(self.tier, error) from error
                log.warning("%s %s unreachable (%s); trying another replica", self.tier, replica.address,
                            error.code().name)
                self.mark_down(replica)
                failed.add(replica.address)
                preferred = ""
            finally:
                replica.in_flight -= 1

    async def _first_ready(self, deadline: float) -> Replica[S]:
        """The first replica whose channel is READY again (gRPC reconnects with its own backoff),
        or UNAVAILABLE once `deadline` passes."""
        waits = {asyncio.ensure_future(r.channel.channel_ready()): r for r in self.replicas}
        done, pending = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                           return_when=asyncio.FIRST_COMPLETED)
        for future in pending:
            future.cancel()
        if not done or time.monotonic() >= deadline:
            raise Unavailable(f"no {self.tier} replica answered within {self.retry_s:.0f} s "
                              f"({', '.join(self._by_address)})")
        return waits[done.pop()]

    async def close(self) -> None:
        for r in self.replicas:
            await r.channel.close()
