"""Batch-invariant numerics: a position's logits do not depend on who shares its forward pass.

Why: a sampled draw compares a uniform u (keyed on seed and position) with the
target's CDF. If a position's logits move by float rounding, u can land on the
other side of a boundary, and the same seeded request gives a different (still
legitimate) token. Rounding moves with the *shape* of the computation: how many
sessions are batched together, how many tokens a step feeds, whether a cache
was built token by token or rebuilt in one prefill after a replica died. Stock
kernels pick their blocking and reduction order by shape, so a session's
logits differed by up to ~4e-5 between those ways (measured), and about 1
sampled stream in 40 under load differed from its undisturbed twin.

How: every op of the forward pass computes a row the same way whatever the
shape around it. Measured op by op on this build (tools/invariance_probe.py):
- oneDNN's matrix multiply gives bit-identical rows for any M >= 2, any N >= 2,
  and for any K padded with trailing zeros; M = 1 and N = 1 take other paths.
  So every Linear goes through oneDNN with a lone row doubled
  (specmesh.fast_linear).
- Attention is written here with those same oneDNN products. Keys are laid out
  so that index = position (a batched pass left-pads caches; the mask says by
  how much), masked scores become exact zeros, and the softmax denominator is
  P times a row of ones by the same kernel, so no reduction runs over a length that
  depends on the batch.
- RMSNorm, softmax over the vocabulary, SiLU, RoPE and exp were already
  row-invariant (checked by the same probe).
- A draft tree (specmesh.tree) masks keys *between* a node's ancestors, not
  only after them; those exact zeros inside K leave its rows with the bits of
  the node's path fed as a chain too (tests/test_invariant.py, and 56 of 56
  cases at contexts of 300-1,300 tokens on this build).

tools/invariance_probe.py checks all of this on another machine in a minute.

The result is the same model computed by different kernels: logits agree with
stock SDPA to float rounding, as packed weights do. What it buys is that the
rounding is a function of the session's tokens alone, so greedy and sampled
outputs are identical under batching, chunking and cache rebuilds. It holds
between replicas of the same build on the same kind of CPU; another CPU
generation (AVX-512 against AVX2) or another torch can round differently.
"""
from __future__ import annotations

import logging
import os
import threading

import torch
from torch import nn

from specmesh.fast_linear import available, fuse_siblings, onednn_matmul, pack_linears, unfuse_siblings

__all__ = ["ATTENTION", "invariant_attention", "make_batch_invariant"]

log = logging.getLogger("specmesh.invariant")

# The name registered with transformers' AttentionInterface (and its mask interface).
ATTENTION = "specmesh_batch_invariant"


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T through oneDNN: each row's result is independent of M (>= 2), of N
    (>= 2), and of trailing zeros along K. A lone row or column is doubled, since M = 1 and N = 1 take
    other kernels. The weight may be a transposed view (oneDNN reads either layout, with the same bits)."""
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        weight = weight.contiguous()
    if weight.shape[0] == 1:   # a single key (a one-token prompt)
        return onednn_matmul(x, weight.expand(2, -1).contiguous())[:, :1]
    return onednn_matmul(x, weight)


def invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs: object) -> tuple[torch.Tensor, None]:
    """Causal attention whose every output row depends only on its own query and keys.

    query [b, Hq, T, D]; key, value [b, Hkv, L, D]; attention_mask [b, 1, T, L] bool (True: attend),
    as made by the mask function registered beside this. Returns ([b, T, Hq, D], None).
    """
    if dropout:
        raise ValueError("batch-invariant attention is for inference (dropout must be 0)")
    unsupported = [name for name in ("softcap", "s_aux", "position_bias") if kwargs.get(name) is not None]
    if unsupported:   # make_batch_invariant's check at load catches this first and keeps stock attention
        raise NotImplementedError(f"batch-invariant attention does not implement {', '.join(unsupported)}")
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    query = query * (dim ** -0.5 if scaling is None else scaling)
    out = query.new_empty(batch, length, heads, dim)
    for b in range(batch):
        start, bias = _layout(attention_mask, b, length, keys)      # bias [T, n]: 0 where allowed, else -inf
        n = keys - start
        k, v = key[b, :, start:], value[b, :, start:]               # [Hkv, n, D], index == position
        # One product per group of heads sharing a key head: rows (head in group, t) against that group's
        # keys, then against its values, read in place (oneDNN reads V [n, D] as the transposed weight, and
        # gives the bits of a copied V^T). Measured beside one cross-group product that does 3x the
        # arithmetic in one call: the per-group calls cost less, with no copy of V per layer and step.
        rows = query[b].reshape(kv_heads, -1, dim)                  # [Hkv, G x T, D]
        scores = torch.stack([_matmul(rows[g], k[g]) for g in range(kv_heads)])    # [Hkv, G x T, n]
        scores = scores.view(heads, length, n).add_(bias)
        top = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)  # a row with no key
        weights = scores.sub_(top).exp_()                                           # masked: exactly 0
        grouped = weights.view(kv_heads, -1, n)
        summed = torch.stack([_matmul(grouped[g], v[g].t()) for g in range(kv_heads)])   # [Hkv, G x T, D]
        # The softmax's denominator as a product with a row of ones, by the same kernel over the same n
        # (a plain sum's order depends on n): the bits of the column it was beside V before.
        total = _matmul(weights.view(heads * length, n), _ones(n, weights))[:, :1]   # [H x T, 1]
        result = summed.view(heads * length, dim) / total.clamp_min_(torch.finfo(total.dtype).tiny)
        out[b] = result.view(heads, length, dim).transpose(0, 1)
    return out, None


_memo = threading.local()


def _ones(n: int, like: torch.Tensor) -> torch.Tensor:
    """Two [n] rows of ones (N = 1 takes another kernel), kept per thread for the last n: every layer
    of a forward pass asks for the same one."""
    ones = getattr(_memo, "ones", None)
    if ones is None or ones.shape[1] != n or ones.dtype != like.dtype:
        ones = _memo.ones = torch.ones(2, n, dtype=like.dtype)
    return ones


def _layout(mask: torch.Tensor | None, b: int, length: int, keys: int) -> tuple[int, torch.Tensor]:
    """(first key of batch row b, additive mask [T, L - first]). The same mask object comes back for
    every layer of one forward pass, so this is worked out once per pass, not once per layer."""
    if getattr(_memo, "mask", None) is not mask or mask is None:
        _memo.mask, _memo.rows = mask, {}
    if b not in _memo.rows:
        # No mask: only a causal pattern, the queries are the last T positions. Padded keys
        # (specmesh.padded_cache) always come with one: _full_mask always makes it.
        if mask is None:
            allowed = torch.arange(keys)[None] <= torch.arange(keys - length, keys)[:, None]
        else:
            allowed = mask[b, 0]                                                     # [T, L]
            if allowed.shape[-1] < keys:   # keys padded past the sequence (specmesh.padded_cache): masked
                allowed = torch.cat([allowed, allowed.new_zeros(length, keys - allowed.shape[-1])], dim=-1)
        # A batched pass left-pads shorter caches: drop the padding (no row attends to it) so that
        # key index == position. Only keys that no row may see are dropped, whatever the mask's pattern.
        seen = allowed.any(dim=0)
        start = int(seen.int().argmax()) if bool(seen.any()) else 0
        bias = torch.zeros(allowed.shape[0], keys - start).masked_fill_(~allowed[:, start:], float("-inf"))
        _memo.rows[b] = (start, bias)
    return _memo.rows[b]


# Entries kept by oneDNN's primitive cache and by ideep's cache of computations (torch's
# oneDNN binding). Each holds ~100 KB, and attention meets a new shape on nearly every
# step (the key count grows), so at their default of 1,024 each, a verifier's resident
# memory rose ~400 MB under load and stayed there. A forward pass reuses a few dozen
# shapes (each layer type at the step's row count), which 128 holds.
ONEDNN_CACHE_ENTRIES = 128


def _bound_onednn_caches() -> None:
    """Both caches read their capacity when first used: before the first oneDNN call. A value
    set in the environment by the operator wins."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def _full_mask(*args, **kwargs):
    """transformers' SDPA mask, always materialised: the attention above reads the padding from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, invariant_attention)
    AttentionMaskInterface.register(ATTENTION, _full_mask)


def make_batch_invariant(model: nn.Module, fuse: bool = True) -> bool:
    """Switch a loaded fp32 CPU model to batch-invariant numerics, in place. Returns False (and
    changes nothing) where oneDNN is not there to provide it (another device or dtype), or where the
    model's attention needs something this one does not do (a soft cap, sinks): checked at load
    against the model's own attention on a few tokens, so a model it does not fit keeps its own.
    With `fuse`, sibling projections (q/k/v, gate/up) share one product each (fast_linear.SIBLINGS),
    kept only where the probe's logits come out the same bits as unfused (leave it off for weights that
    will be repacked, as bf16 drafts are)."""
    if not available(model):
        return False
    _bound_onednn_caches()
    # The outermost transformers model (an EAGLE or distilled draft wraps one) hands it down to its parts.
    models = [m for m in model.modules() if hasattr(m, "set_attn_implementation")]
    if not models:
        return False
    lm = models[0]
    _register()
    before = lm.config._attn_implementation
    probe = torch.arange(1, 9).remainder(lm.config.get_text_config().vocab_size)[None]     # [1, 8]
    with torch.inference_mode():
        expected = lm(input_ids=probe).logits
        lm.set_attn_implementation(ATTENTION)
        try:
            got = lm(input_ids=probe).logits
            fits = torch.allclose(got, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))
        except (NotImplementedError, ValueError, RuntimeError) as error:
            fits, reason = False, str(error)
        else:
            reason = f"its logits differ from {before}'s"
    if not fits:
        lm.set_attn_implementation(before)
        log.warning("batch-invariant numerics left off: this model's attention does not fit them (%s)", reason)
        return False
    pack_linears(model, invariant=True)
    if fuse:
        _fuse_if_same_bits(lm, probe)
    return True


def _fuse_if_same_bits(lm: nn.Module, probe: torch.Tensor) -> None:
    with torch.inference_mode():
        expected = [lm(input_ids=ids).logits for ids in (probe, probe[:, :1])]
        fused = fuse_siblings(lm)
        if not fused:
            return
        got = [lm(input_ids=ids).logits for ids in (probe, probe[:, :1])]
    if all(torch.equal(a, b) for a, b in zip(got, expected)):
        log.info("fused %d groups of sibling projections into one oneDNN product each", len(fused))
    else:   # another oneDNN build whose columns depend on N: keep the separate products
        unfuse_siblings(fused)
        log.warning("sibling projections left unfused: the fused product's bits differ on this build")
