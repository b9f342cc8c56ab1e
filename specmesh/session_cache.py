"""A replica's per-session state: a bounded, idle-expiring map from session id.

(The orchestrator's Redis session records are `orchestrator.sessions.SessionStore`.)

Both the draft and the verifier keep KV caches in process memory (they are
cheap to lose: Redis holds what rebuilds them). Memory is bounded by a maximum
number of sessions with least-recently-used eviction and by an idle TTL; an
evicted session simply gets a cache miss, and the orchestrator rebuilds it
by resending the committed tokens (start = 0).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class SessionCache(Generic[T]):
    def __init__(self, max_sessions: int, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        assert max_sessions > 0, f"max_sessions must be positive, got {max_sessions}"
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, T]] = OrderedDict()
        self.evictions = 0

    def get(self, key: str) -> T | None:
        self._expire()
        entry = self._items.get(key)
        if entry is None:
            return None
        self._items[key] = (self._clock(), entry[1])
        self._items.move_to_end(key)
        return entry[1]

    def put(self, key: str, value: T) -> None:
        self._items[key] = (self._clock(), value)
        self._items.move_to_end(key)
        while len(self._items) > self.max_sessions:
            self._items.popitem(last=False)
            self.evictions += 1

    def pop(self, key: str) -> T | None:
        entry = self._items.pop(key, None)
        return None if entry is None else entry[1]

    def snapshot(self) -> list[T]:
        """The cached states, safe to call from another thread (a metrics scrape) while
        the model thread changes the cache: a change mid-copy is retried."""
        for _ in range(5):
            try:
                return [v for _, v in list(self._items.values())]
            except RuntimeError:
                continue
        return []

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        deadline = self._clock() - self.idle_ttl_s
        while self._items:
            key, (touched, _) = next(iter(self._items.items()))
            if touched >= deadline:
                break
            del self._items[key]
            self.evictions += 1
