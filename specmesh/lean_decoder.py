"""A Llama-family decoder stack run without transformers' per-call machinery: the EAGLE draft, and the target.

Why: the EAGLE draft is one decoder layer that runs three times a Propose, on one
CPU thread. Of each pass (~0.9 ms after a 300-token context), transformers' forward
around the layer (output capturing, kwargs plumbing, the mask factory, the kernel
hub's wrappers) took ~0.15 ms; the products themselves are small. The target pays
the same per layer: SmolLM2-135M's 30 layers spent 5-7% of a 1- or 6-token step
in it on the slower build CPU (docs/benchmarks.md, "The target's lean forward").

What: the same modules (norms, the packed linear layers, the rotary embedding),
the same cache (specmesh.padded_cache) and the same attention function
(specmesh.invariant), called directly, in the order transformers' Llama calls
them. `lean_decoder` turns it on only for a model whose structure it knows and
only after a probe gives bit for bit the hidden states transformers' forward
gives (a causal feed, a feed after a cache, a tree mask); anything else keeps
transformers' forward. `use_lean_forward` does the same for a causal LM (the
verifier's target, a plain draft), whose every forward then goes through
`lm_forward`, probed also on a padded batch.
"""
from __future__ import annotations

import logging

import torch

from specmesh.invariant import ATTENTION, invariant_attention
from specmesh.padded_cache import new_cache

log = logging.getLogger("specmesh.lean_decoder")

__all__ = ["LeanCausalLM", "LeanDecoder", "lean_decoder", "lm_forward", "use_lean_forward"]

# Where use_lean_forward leaves a causal LM's lean forward (read by lm_forward).
LEAN = "specmesh_lean"


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
    if not _known(model.config):
        return None
    lean = LeanDecoder(model)
    return lean if _fits(_probe, model, lean, "the draft", "its hidden states") else None


def _known(config) -> bool:
    """A Llama decoder on the batch-invariant attention: the structure LeanDecoder runs."""
    return getattr(config, "model_type", None) == "llama" and config._attn_implementation == ATTENTION


def _fits(probe, model, lean, who: str, what: str) -> bool:
    """Run `probe(model, lean)`; on other bits, or an error, log why `who` keeps transformers' forward."""
    try:
        with torch.inference_mode():
            same = probe(model, lean)
    except (AttributeError, TypeError, ValueError, RuntimeError, NotImplementedError) as error:
        same, why = False, f"{type(error).__name__}: {error}"
    else:
        why = f"{what} differ from transformers' forward"
    if not same:
        log.warning("%s keeps transformers' forward: the lean decoder does not fit it (%s)", who, why)
    return same


def _probe_tree() -> tuple[torch.Tensor, torch.Tensor]:
    """Both probes' tree after 10 tokens: two siblings and a child of the first, masked to their ancestors.
    (mask [1, 1, 3, 13], position_ids [1, 3])."""
    tree = torch.tensor([[True, False, False], [False, True, False], [True, False, True]])
    return torch.cat([torch.ones(3, 10, dtype=torch.bool), tree], dim=1)[None, None], torch.tensor([[10, 10, 11]])


def _probe(model, lean: LeanDecoder) -> bool:
    """Three calls as a Propose makes them, through both paths: 8 tokens, 2 more after them, then 3 tree
    nodes (two siblings and a child of the first) masked to their ancestors."""
    from specmesh.models import cache_kwargs

    hidden_size = model.config.hidden_size
    embeds = torch.linspace(-2, 2, 13 * hidden_size).view(1, 13, hidden_size).sin()
    ours, theirs = new_cache(model.config), new_cache(model.config)
    for part, mask, positions in ((slice(0, 8), None, None), (slice(8, 10), None, None),
                                  (slice(10, 13), *_probe_tree())):
        want = model(inputs_embeds=embeds[:, part], attention_mask=mask, position_ids=positions,
                     **cache_kwargs(model, theirs)).last_hidden_state
        got = lean(embeds[:, part], ours, mask, positions)
        if not torch.equal(got, want):
            return False
    return True


class LeanCausalLM:
    """A transformers LlamaForCausalLM's forward with a cache, on a LeanDecoder: (logits, last hidden state)."""

    def __init__(self, model, decoder: LeanDecoder):
        self.model, self.decoder = model, decoder

    def __call__(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """attention_mask: None (causal after the cache), [B, cached + T] (0: padding) or 4D bool. Returns
        the logits of the last `rows` positions (0: all) [B, rows, V] and the final norm's output [B, T, H]."""
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = _causal(attention_mask, cache.get_seq_length(), input_ids.shape[1])
        hidden = self.decoder(self.model.model.embed_tokens(input_ids), cache, attention_mask, position_ids)
        return self.model.lm_head(hidden[:, -rows:] if rows else hidden), hidden


def _causal(padding: torch.Tensor, cached: int, length: int) -> torch.Tensor:
    """[B, cached + T] padding mask -> [B, 1, T, cached + T] bool: what transformers' mask factory makes of it
    (query t, at cache position cached + t, sees the unpadded keys up to its own)."""
    keys = torch.arange(padding.shape[-1], device=padding.device)
    causal = keys[None] <= torch.arange(cached, cached + length, device=padding.device)[:, None]   # [T, L]
    return (padding.bool()[:, None, None, :] & causal[None, None])


def lm_forward(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None, rows: int = 0,
               hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A causal LM's forward over `cache`: logits of the last `rows` positions (0: all) [B, rows, V], and with
    `hidden` the last hidden state [B, T, H] (else None). Through the lean forward where use_lean_forward
    installed one (the same bits), else transformers' own."""
    lean = getattr(model, LEAN, None)
    if lean is not None:
        logits, last = lean(input_ids, cache, attention_mask, position_ids, rows)
        return logits, last if hidden else None
    from specmesh.models import cache_kwargs

    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=rows,
                output_hidden_states=hidden, **cache_kwargs(model, cache))
    return out.logits, out.hidden_states[-1] if hidden else None


def use_lean_forward(model) -> bool:
    """Send `model`'s lm_forward calls through a LeanCausalLM when that gives transformers' logits and last
    hidden state bit for bit on a probe (chains, a tree, a padded batch); True if it does. Checked after
    the kernels are set up, on the layers as they will be served."""
    setattr(model, LEAN, None)
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(model, "lm_head") or not hasattr(inner, "embed_tokens") \
            or not _known(inner.config):
        return False
    lean = LeanCausalLM(model, LeanDecoder(inner))
    if not _fits(_probe_lm, model, lean, "the model", "its logits or hidden states"):
        return False
    setattr(model, LEAN, lean)
    log.info("forward passes run on the lean decoder (same bits as transformers' forward)")
    return True


def _probe_lm(model, lean: LeanCausalLM) -> bool:
    """As a verifier calls it: a prompt of 8, 2 more after it (last row only), a tree of 3 after those,
    and a batch of two caches of different lengths, left-padded, whose inputs are right-padded."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.arange(3, 3 + 16).remainder(vocab)[None]                                       # [1, 16]
    calls = [(ids[:, :8], None, None, 0), (ids[:, 8:10], None, None, 1), (ids[:, 10:13], *_probe_tree(), 0)]
    ours, theirs = new_cache(model.config), new_cache(model.config)
    for feed, mask, positions, rows in calls:
        if not _same(lm_forward(model, feed, theirs, mask, positions, rows, hidden=True),
                     lean(feed, ours, mask, positions, rows)):
            return False
    # Batched as verifier_service.batching does it: caches of 5 and 2 tokens, the shorter left-padded to 5;
    # row 0 feeds 2 tokens, row 1 one, right-padded.
    short, long = new_cache(model.config), new_cache(model.config)
    lm_forward(model, ids[:, :5], long)
    lm_forward(model, ids[:, :2], short)
    padding = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 0]])
    positions = torch.tensor([[5, 6], [2, 3]])
    feed = torch.stack([ids[0, 5:7], torch.stack([ids[0, 2], ids[0, 0]])])
    batches = [new_cache(model.config), new_cache(model.config)]
    for cache in batches:
        for layer, (a, b) in enumerate(zip(long.layers, short.layers)):
            cache.update(torch.cat([a.keys, torch.nn.functional.pad(b.keys, (0, 0, 3, 0))]),
                         torch.cat([a.values, torch.nn.functional.pad(b.values, (0, 0, 3, 0))]), layer)
    return _same(lm_forward(model, feed, batches[0], padding, positions, 0, hidden=True),
                 lean(feed, batches[1], padding, positions, 0))


def _same(theirs: tuple[torch.Tensor, torch.Tensor], ours: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(theirs, ours))
