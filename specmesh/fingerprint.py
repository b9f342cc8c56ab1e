"""Fingerprints of a session's committed prefix: what lets a replica prove its cache.

A replica's cache is trusted only for a prefix whose fingerprint matches the one
the orchestrator computed from Redis's committed tokens. The fingerprint is a
rolling hash chained per token, h(0) = ROOT, h(n + 1) = mix(h(n), token n), so
both sides extend it in O(new tokens) per step. A cache that does not match (a
bug, a race, a stranger's Prefill under the same session id) is a cache miss,
and the orchestrator rebuilds it from the committed tokens: the output stays
the target's whatever happened to the cache. Not a MAC: it detects corruption,
while the locked door (mTLS, tokens) keeps strangers out.
"""
from __future__ import annotations

from typing import Iterable

_MASK64 = (1 << 64) - 1
ROOT = 0x5EC0DE5EC0DE5EC0   # the fingerprint of the empty prefix


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def extend(h: int, tokens: Iterable[int]) -> int:
    """The fingerprint of a prefix extended by `tokens`; never 0 (0 means "none sent")."""
    for token in tokens:
        h = splitmix64(h ^ (token & 0xFFFFFFFF)) or 1
    return h


class PrefixFingerprints:
    """h(n) for every prefix length n of a growing sequence, extended as tokens are committed."""

    def __init__(self, tokens: Iterable[int] = ()):
        self._h = [ROOT]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._h.append(extend(self._h[-1], (token,)))

    def truncate(self, length: int) -> None:
        del self._h[length + 1:]

    def __len__(self) -> int:
        return len(self._h) - 1

    def at(self, length: int) -> int:
        return self._h[length]
