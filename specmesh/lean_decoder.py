"""A Llama-family decoder stack run without transformers' per-call machinery, for the EAGLE draft.

Why: the EAGLE draft is one decoder layer that runs three times a Propose, on one
CPU thread. Of each pass (~0.9 ms after a 300-token context), transformers' forward
around the layer (output capturing, kwargs plumbing, the mask factory, the kernel
hub's wrappers) took ~0.15 ms; the products themselves are small.

What: the same modules (norms, the packed linear layers, the rotary embedding),
the same cache (specmesh.padded_cache) and the same attention function
(specmesh.invariant), called directly, in the order transformers' Llama calls
them. `lean_decoder` turns it on only for a model whose structure it knows and
only after a probe gives bit for bit the hidden states transformers' forward
gives (a causal feed, a feed after a cache, a tree mask); anything else keeps
transformers' forward.
"""
from __future__ import annotations

import logging

import torch

from specmesh.invariant import ATTENTION, invariant_attention
from specmesh.padded_cache import new_cache

log = logging.getLogger("specmesh.lean_decoder")


class LeanDecoder:
    """`model` (a transformers LlamaModel)'s forward over inputs_embeds with a cache: hidden [B, T, H]."""

    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model = model
        self.rotate = apply_rotary_pos_emb

    def __call__(self, inputs_embeds: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """attention_mask: None (causal after the cache) or [B, 1, T, cached + T] bool (True: attend),
        as transformers takes it with this attention (specmesh.models.custom_attention_mask)."""
        model = self.model
        batch, length = inputs_embeds.shape[:2]
        cached = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(cached, cached + length, device=inputs_embeds.device)[None]
        if attention_mask is None:   # what transformers' mask factory makes for this attention, every key in it
            keys = torch.arange(cached + length, device=inputs_embeds.device)
            attention_mask = (keys[None] <= keys[cached:, None])[None, None].expand(batch, 1, length, -1)
        hidden = inputs_embeds
        cos, sin = model.rotary_emb(hidden, position_ids=position_ids)
        for layer in model.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (batch, length, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx)
            out, _ = invariant_attention(attn, q, k, v, attention_mask, scaling=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(batch, length, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return model.norm(hidden)


def lean_decoder(model) -> LeanDecoder | None:
    """A LeanDecoder for `model` (a transformers LlamaModel on the batch-invariant attention) when it gives
    transformers' own hidden states bit for bit on a probe; None (keep transformers' forward) otherwise."""
    config = model.config
    if config.model_type != "llama" or config._attn_implementation != ATTENTION:
        return None
    lean = LeanDecoder(model)
    try:
        with torch.inference_mode():
            same = _probe(model, lean)
    except (AttributeError, TypeError, ValueError, RuntimeError, NotImplementedError) as error:
        same, why = False, f"{type(error).__name__}: {error}"
    else:
        why = "its hidden states differ from transformers' forward"
    if not same:
        log.warning("the draft keeps transformers' forward: the lean decoder does not fit it (%s)", why)
        return None
    return lean


def _probe(model, lean: LeanDecoder) -> bool:
    """Three calls as a Propose makes them, through both paths: 8 tokens, 2 more after them, then 3 tree
    nodes (two siblings and a child of the first) masked to their ancestors."""
    from specmesh.models import cache_kwargs

    hidden_size = model.config.hidden_size
    embeds = torch.linspace(-2, 2, 13 * hidden_size).view(1, 13, hidden_size).sin()
    ours, theirs = new_cache(model.config), new_cache(model.config)
    tree = torch.tensor([[True, False, False], [False, True, False], [True, False, True]])
    tree_mask = torch.cat([torch.ones(3, 10, dtype=torch.bool), tree], dim=1)[None, None]
    for part, mask, positions in ((slice(0, 8), None, None), (slice(8, 10), None, None),
                                  (slice(10, 13), tree_mask, torch.tensor([[10, 10, 11]]))):
        want = model(inputs_embeds=embeds[:, part], attention_mask=mask, position_ids=positions,
                     **cache_kwargs(model, theirs)).last_hidden_state
        got = lean(embeds[:, part], ours, mask, positions)
        if not torch.equal(got, want):
            return False
    return True
