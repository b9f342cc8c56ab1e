"""A KV cache whose attention sees the keys padded to a multiple of KEY_BUCKET.

Why: the batch-invariant attention (specmesh/invariant.py) multiplies through
oneDNN, which builds a kernel (a "primitive") for every new shape and caches
it. transformers' cache hands attention exactly the keys held, more every
step, so every forward pass met new shapes: 0.35-0.75 ms to build each, and
~1.3 ms for one layer's attention that costs 0.15 ms on a shape seen before.
A draft model's single layer runs ~3 times a step and paid that every time:
the EAGLE draft's Propose of 5 took 6.8 ms, 4.2 with this cache; the target's
6-token verify 38.6 ms, 36.7 with it (docs/benchmarks.md, "A padded KV cache").

How: each layer keeps its keys and values in buffers whose length grows in
KEY_BUCKET steps and stays zero past the tokens held. `keys` and `values` are
views of exactly the tokens held, as in transformers' DynamicLayer, so cropping,
moving a tree's entries and counting the length work unchanged; only what
`update` hands the attention is the padded view. The mask still covers the
held tokens only, and the attention treats the keys past it as masked: their
weights are exact zeros against zero values, which oneDNN adds as trailing
zeros of the reduction, so every output has the bits it had unpadded
(tests/test_padded_cache.py). The kernels are rebuilt once every KEY_BUCKET
tokens, and a step no longer copies the whole cache to append one token.

Only a model running that attention gets this cache; any other attention
(SDPA, eager, flash) reads the keys' length as the sequence's, so it keeps
transformers' own.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specmesh.invariant import ATTENTION

# Keys per step of a buffer's length: the attention's shapes change once every this many tokens. A
# larger bucket multiplies more zeros: up to 63 padded keys here, 16% of a 400-token context at worst.
KEY_BUCKET = 64


def padded_length(tokens: int) -> int:
    return -(-tokens // KEY_BUCKET) * KEY_BUCKET


class PaddedLayer(DynamicLayer):
    """A DynamicLayer whose `update` returns its keys and values padded with zeros to a KEY_BUCKET multiple."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @torch.inference_mode()   # the buffers are inference tensors, written in place; serving never trains
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        end = held + key_states.shape[-2]
        size = padded_length(end)
        if not self._holds_views(key_states) or self._key_buffer.shape[-2] < size:
            self._key_buffer = self._grown(self.keys, key_states, held, size)
            self._value_buffer = self._grown(self.values, value_states, held, size)
        self._key_buffer[..., held:end, :] = key_states
        self._value_buffer[..., held:end, :] = value_states
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]
        return self._key_buffer[..., :size, :], self._value_buffer[..., :size, :]

    def crop(self, tokens_to_remove: int) -> None:
        held = self.get_seq_length()
        super().crop(tokens_to_remove)
        if self.is_initialized and self._holds_views():
            kept = self.get_seq_length()
            with torch.inference_mode():
                self._key_buffer[..., kept:held, :] = 0       # past the held tokens a buffer stays zero
                self._value_buffer[..., kept:held, :] = 0

    def _holds_views(self, new: torch.Tensor | None = None) -> bool:
        """`keys` and `values` are still the leading views of the buffers (nothing replaced them, say
        batch_select_indices), and `new` fits their batch and head dimensions."""
        buffer = getattr(self, "_key_buffer", None)
        if buffer is None:
            return False
        if new is not None and (new.shape[:-2] != buffer.shape[:-2] or new.shape[-1] != buffer.shape[-1]
                                or new.dtype != buffer.dtype or new.device != buffer.device):
            return False
        return all(view.numel() == 0 or (view.data_ptr() == whole.data_ptr() and view.shape[:-2] == whole.shape[:-2])
                   for view, whole in ((self.keys, self._key_buffer), (self.values, self._value_buffer)))

    @staticmethod
    def _grown(held: torch.Tensor, like: torch.Tensor, length: int, size: int) -> torch.Tensor:
        """A zero buffer of `size` tokens holding the first `length` of `held`."""
        grown = like.new_zeros(*like.shape[:-2], size, like.shape[-1])
        if length:
            grown[..., :length, :] = held[..., :length, :]
        return grown


def new_cache(config) -> DynamicCache:
    """The KV cache for a model with this config: padded layers under the batch-invariant attention,
    transformers' own otherwise (and for any layer type other than the plain growing one)."""
    cache = DynamicCache(config=config)
    if getattr(config, "_attn_implementation", None) == ATTENTION:
        cache.layers = [PaddedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
