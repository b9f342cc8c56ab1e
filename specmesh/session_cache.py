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
    def __init__(self, max_sessions: int, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_bytes: int | None = None, size_of: Callable[[T], int] | None = None):
        assert max_sessions > 0, f"max_sessions must be positive, got {max_sessions}"
        assert max_bytes is None or size_of is not None, "a byte limit needs size_of"
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        # Sessions count badly for memory (one 8k-token cache outweighs a hundred short ones):
        # with max_bytes, the least recently used go until the rest fit (see trim).
        self.max_bytes, self._size_of = max_bytes, size_of
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

    def trim(self, keep: str = "") -> int:
        """Evict least-recently-used sessions, never `keep` (the one just served), until the
        cached bytes fit max_bytes. Called after work that grew a cache. Returns the bytes held."""
        if self.max_bytes is None:
            return 0
        sizes = {key: self._size_of(value) for key, (_, value) in self._items.items()}
        total = sum(sizes.values())
        for key in list(self._items):
            if total <= self.max_bytes:
                break
            if key != keep:
                del self._items[key]
                total -= sizes[key]
                self.evictions += 1
        return total

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
