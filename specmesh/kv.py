"""A session's tokens on one replica and the KV cache over a prefix of them.

Rollback is a length: rejected draft tokens are dropped by cropping the cache
to the committed prefix the orchestrator names (`start`), never by recomputing.
Used by the verifier for the target and by the draft service for a draft model.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers import DynamicCache

from specmesh.errors import CacheMiss


class TokenHistory:
    """Everything a replica has seen of one session, committed or drafted."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.tokens: list[int] = []

    def sync(self, start: int, tail: Sequence[int]) -> None:
        """Keep the first `start` tokens (the committed prefix) and append `tail`."""
        if start > len(self.tokens):
            raise CacheMiss(self.session_id, len(self.tokens), start)
        del self.tokens[start:]
        self.tokens.extend(tail)


class KVSession(TokenHistory):
    def __init__(self, session_id: str, model):
        super().__init__(session_id)
        self.model = model
        self.cache = DynamicCache(config=model.config)
        # transformers 5.x renamed the forward argument `past_key_values` to `cache`.
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def cached_len(self) -> int:
        return self.cache.get_seq_length()

    def sync(self, start: int, tail: Sequence[int]) -> None:
        super().sync(start, tail)
        if self.cached_len > start:   # entries past the committed prefix may be rejected drafts
            self.cache.crop(start - self.cached_len)

    def feed(self, extra: Sequence[int]) -> tuple[int, list[int]]:
        """What the next forward pass feeds: (cached length kept, tokens to feed).

        The cache is cropped so at least the last known token is fed again: its logits
        are needed, and a cache that already covers every token has none to give.
        """
        keep = min(self.cached_len, len(self.tokens) - 1)
        if keep < self.cached_len:
            self.cache.crop(keep - self.cached_len)   # negative: drop that many from the end
        return keep, self.tokens[keep:] + list(extra)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.cache.layers[layer]
        return entry.keys, entry.values                # [1, H, cached_len, D] each

    def replace_cache(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Install a cache built elsewhere (a batched forward): one (keys, values) pair per layer."""
        self.cache = DynamicCache(config=self.model.config)
        for index, (keys, values) in enumerate(layers):
            self.cache.update(keys, values, index)

    def model_input(self, feed: Sequence[int]) -> torch.Tensor:
        """[1, T] input ids for the model; a draft over its own vocabulary maps target ids here."""
        return torch.tensor([feed], dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def forward(self, extra: Sequence[int] = (), last_only: bool = False) -> torch.Tensor:
        """Feed every token not yet cached plus `extra`; return the logits that
        predict the positions len(tokens) .. len(tokens) + len(extra).

        Returns [len(extra) + 1, V], or [1, V] (the last position) with `last_only`,
        which skips the output projection for the other positions.
        """
        assert self.tokens, "forward() before any token was synced"
        _, feed = self.feed(extra)
        input_ids = self.model_input(feed)                                             # [1, T]
        rows = 1 if last_only else len(extra) + 1
        logits = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=rows,
                            **{self.cache_arg: self.cache}).logits[0]                  # [rows, V]
        self.tokens.extend(extra)
        return logits[-rows:].float()
