"""A session's tokens on one replica and the KV cache over a prefix of them.

Rollback is a length: rejected draft tokens are dropped by cropping the cache
to the committed prefix the orchestrator names (`start`), never by recomputing.
A draft tree (specmesh.tree) is the one exception: after its pass the cache
holds every node, and the next sync moves the accepted path's entries into
place before cropping, so the accepted tokens are never fed twice.
Used by the verifier for the target and by the draft service for a draft model.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from specmesh import engine_host, fingerprint, tree
from specmesh.errors import CacheMiss, InvalidArgument
from specmesh.lean_decoder import lm_forward
from specmesh.padded_cache import new_cache

# Tokens per forward pass when feeding a long sequence (see KVSession.forward).
PREFILL_CHUNK = 512



class TokenHistory:
    """Everything a replica has seen of one session, committed or drafted."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.tokens: list[int] = []
        # Fingerprints of the prefix the orchestrator last confirmed as committed (drafts
        # after it may still change); extended, never recomputed from the start.
        self.confirmed = fingerprint.PrefixFingerprints()

    def fingerprint(self, length: int) -> int:
        known = len(self.confirmed)
        if length <= known:
            return self.confirmed.at(length)
        return fingerprint.extend(self.confirmed.at(known), self.tokens[known:length])

    def sync(self, start: int, tail: Sequence[int], prefix_fingerprint: int | None = None) -> None:
        """Keep the first `start` tokens (the committed prefix) and append `tail`.

        With `prefix_fingerprint` (what a caller over the wire always sends), the kept
        tokens must hash to it: a cache that cannot prove its prefix is a cache miss.
        None trusts the caller (in-process use).
        """
        if start < 0:   # a negative index would crop from the end
            raise InvalidArgument("sync.start", f"must be >= 0, got {start}")
        if start > len(self.tokens):
            raise CacheMiss(self.session_id, len(self.tokens), start)
        if start and prefix_fingerprint is not None and self.fingerprint(start) != prefix_fingerprint:
            raise CacheMiss(self.session_id, len(self.tokens), start, "its tokens do not match the prefix fingerprint")
        known = len(self.confirmed)
        if start < known:
            self.confirmed.truncate(start)
        else:
            self.confirmed.extend(self.tokens[known:start])
        del self.tokens[start:]
        self.tokens.extend(tail)
        self.confirmed.extend(tail)


class KVSession(TokenHistory):
    def __init__(self, session_id: str, model):
        super().__init__(session_id)
        self.model = model
        self.cache = new_cache(model.config)
        # After a forward with features=True: (position of the first fed token, [fed, H] the model's last
        # hidden state after its final norm at every fed position), for a draft that reads them (EAGLE).
        self.fed_features: tuple[int, torch.Tensor] | None = None
        # After a tree's pass: (position of its first node, node tokens, parents). The cache holds every
        # node; `tokens` only the first chain's, until the next sync keeps the accepted path.
        self.pending_tree: tuple[int, list[int], list[int]] | None = None

    @property
    def cached_len(self) -> int:
        return self.cache.get_seq_length()

    def sync(self, start: int, tail: Sequence[int], prefix_fingerprint: int | None = None) -> None:
        placed = self._place_tree(start, tail) if self.pending_tree else 0
        super().sync(start, tail, prefix_fingerprint)
        keep = start + placed        # entries past the committed prefix may be rejected drafts
        if self.cached_len > keep:
            self.cache.crop(keep - self.cached_len)

    @torch.inference_mode()   # the cache's tensors were made in inference mode; moving them is too
    def _place_tree(self, start: int, tail: Sequence[int]) -> int:
        """Keep the cache entries of the tree's accepted path: those of the first chain up to `start`, then
        the nodes that the first committed tokens of `tail` follow down the tree, moved to the positions
        after them. Returns how many of `tail` are cached that way (0 when the sync does not continue
        the tree: everything past the first chain is dropped)."""
        base, nodes, parents = self.pending_tree
        self.pending_tree = None
        chain = tree.first_chain(parents)
        if not base <= start <= base + chain:
            self.cache.crop(base + chain - self.cached_len)
            return 0
        path = list(range(start - base))
        kids = tree.children(parents)
        for token in tail:
            child = next((c for c in kids[(path[-1] if path else -1) + 1] if nodes[c] == token), None)
            if child is None:
                break
            path.append(child)
        if path != list(range(len(path))):   # an off-chain node: its entries move to where the path puts it
            source = torch.tensor(path, device=self.cache.layers[0].keys.device) + base
            for layer in self.cache.layers:
                layer.keys[:, :, base:base + len(path)] = layer.keys[:, :, source]
                layer.values[:, :, base:base + len(path)] = layer.values[:, :, source]
        self.cache.crop(base + len(path) - self.cached_len)
        return len(path) - (start - base)

    def took(self, extra: Sequence[int], parents: Sequence[int] | None = None) -> None:
        """After a pass that fed `extra`: a chain's tokens join the sequence; of a tree, only the first
        chain's do, and the other nodes wait in the cache for the next sync (`_place_tree`)."""
        if parents is None or tree.is_chain(parents):
            self.tokens.extend(extra)
            return
        self.pending_tree = (len(self.tokens), list(extra), list(parents))
        self.tokens.extend(extra[:tree.first_chain(parents)])

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
        self.cache = new_cache(self.model.config)
        for index, (keys, values) in enumerate(layers):
            self.cache.update(keys, values, index)

    def model_input(self, feed: Sequence[int]) -> torch.Tensor:
        """[1, T] input ids for the model; a draft over its own vocabulary maps target ids here."""
        return torch.tensor([feed], dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def forward(self, extra: Sequence[int] = (), last_only: bool = False, features: bool = False,
                parents: Sequence[int] | None = None) -> torch.Tensor:
        """Feed every token not yet cached plus `extra`; return the logits that
        predict the positions len(tokens) .. len(tokens) + len(extra).

        Returns [len(extra) + 1, V], or [1, V] (the last position) with `last_only`,
        which skips the output projection for the other positions. With `features`,
        also keeps the features of every fed position in `fed_features` (else None).
        With `parents`, `extra` is a draft tree (specmesh.tree): row 0 is after the
        last known token, row i + 1 after node i.
        """
        assert self.tokens, "forward() before any token was synced"
        keep, feed = self.feed(extra)
        rows = 1 if last_only else len(extra) + 1
        gathered: list[torch.Tensor] = []
        # A long feed (a prompt, a cache rebuilt) goes in chunks, so work whose caller gave up
        # (deadline passed, client gone) stops at the next chunk instead of running to the end.
        while len(feed) > PREFILL_CHUNK + rows:
            engine_host.check_abandoned()
            self._run(feed[:PREFILL_CHUNK], 1, gathered if features else None)
            feed = feed[PREFILL_CHUNK:]
        engine_host.check_abandoned()
        tree_parents = None if parents is None or tree.is_chain(parents) else parents
        logits = self._run(feed, rows, gathered if features else None, tree_parents)
        self.fed_features = (keep, torch.cat(gathered)) if features else None
        self.took(extra, parents)
        return logits[-rows:].float()

    def _run(self, feed: Sequence[int], rows: int, features: list | None = None,
             parents: Sequence[int] | None = None) -> torch.Tensor:
        input_ids = self.model_input(feed)                                             # [1, T]
        layout = {}
        if parents is not None:   # the last len(parents) fed tokens are a tree's nodes
            positions, mask = tree.attention_mask(self.model, self.cached_len, len(feed) - len(parents), parents)
            layout = {"position_ids": positions, "attention_mask": mask}
        logits, hidden = lm_forward(self.model, input_ids, self.cache, rows=rows, hidden=features is not None,
                                    **layout)
        if features is not None:
            features.append(hidden[0])                                                 # [T, H]
        return logits[0]                                                               # [rows, V]


def tensor_bytes(tensor, seen: set) -> int:
    """Memory behind a tensor: its storage, counted once per `seen` set (a cropped cache
    tensor is a view of a larger one; a batched forward leaves sessions sharing one)."""
    if tensor is None:
        return 0
    storage = tensor.untyped_storage()
    key = (storage.device.type, storage.data_ptr())
    if key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()


def cache_nbytes(cache: DynamicCache | None, seen: set | None = None) -> int:
    """Bytes held by a transformers cache's key and value tensors."""
    seen = set() if seen is None else seen
    return sum(tensor_bytes(getattr(layer, name, None), seen)
               for layer in list(getattr(cache, "layers", ()) or ()) for name in ("keys", "values"))


def cache_bytes(sessions) -> int:
    """KV-cache bytes behind a replica's cached sessions (a SessionCache of KVSession, or of
    states holding one). Read from the metrics thread while the model thread works: a cache
    changing mid-count is skipped, never an error in a scrape."""
    total, seen = 0, set()
    for state in sessions.snapshot():
        kv = state if isinstance(state, KVSession) else getattr(state, "state", None)
        try:
            total += cache_nbytes(getattr(kv, "cache", None), seen)
        except (RuntimeError, AttributeError):
            continue
    return total
