"""Sampling primitives shared by the draft and the verifier.

Temperature, top-k and top-p (`process_logits`) are applied identically to the
draft's q and the target's p, which is what keeps speculative sampling exact;
every random draw is counter-based, `uniform(seed, position, stream)`, where
position is the absolute index (prompt + committed) of the token being chosen,
so a seeded session reproduces across processes and replicas.

The speculative rule itself, and the glossary (draft / accepted / recovered /
bonus / committed), are in `specmesh.speculative`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from specmesh.fingerprint import splitmix64

__all__ = ["Stream", "SamplingParams", "uniform", "process_logits", "sample", "truncate_top_n"]


class Stream(enum.IntEnum):
    """Independent random streams; one uniform per (seed, position, stream)."""
    DRAFT = 1    # draft samples x_i from q_i
    ACCEPT = 2   # orchestrator's accept/reject test
    TARGET = 3   # verifier's recovered / bonus draws (never both used at one position)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1.0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int, stream: Stream, index: int = 0) -> float:
    """Uniform in [0, 1): splitmix64 chain of (seed, position, stream), 53-bit mantissa.

    `index` > 0 gives further independent draws at one (seed, position, stream): a draft
    tree tests several siblings at one position, each with its own draw."""
    h = splitmix64(seed & _MASK64)
    h = splitmix64(h ^ (position & _MASK64))
    h = splitmix64(h ^ int(stream))
    if index:
        h = splitmix64(h ^ (index & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] float32 probs: temperature, top-k, top-p, softmax.

    Greedy gives a one-hot at the argmax (ties -> lowest id). Ties at the top-k /
    top-p boundary are broken towards the lowest id, so exactly top_k tokens remain.
    """
    V = logits.shape[-1]
    if params.greedy:   # the same one-hot as one_hot(argmax).float(), without its int64 [..., V] in between
        top = logits.argmax(dim=-1, keepdim=True)                                        # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    # The max is subtracted before dividing, so a tiny temperature (1e-40) sends the others to
    # -inf and the max to 0, never to inf - inf = NaN; softmax does not care about the shift.
    x = logits.to(torch.float32)                                                       # [..., V]
    x = (x - x.max(dim=-1, keepdim=True).values) / params.temperature                  # [..., V]
    if not (0 < params.top_k < V) and params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)               # [..., V]
    keep = torch.ones_like(sorted_x, dtype=torch.bool)                                  # [..., V], sorted order
    if 0 < params.top_k < V:
        keep[..., params.top_k:] = False
    if params.top_p < 1.0:
        ps = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1).double()  # [..., V]
        keep &= (ps.cumsum(dim=-1) - ps) < params.top_p  # mass before j < top_p; first always kept
    mask = torch.zeros_like(keep).scatter(-1, order, keep)                              # [..., V], vocab order
    return torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1)


def sample_rows(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws for a batch: [R, V] probs (each row's sum need not be 1) and [R] uniforms in [0, 1)
    -> [R] token ids. `sample` is its one-row case; distill's data draw whole batches with it."""
    cdf = probs.to(torch.float64).cumsum(-1)                                            # [R, V]
    total = cdf[:, -1:]                                                                 # [R, 1]
    if not bool((total > 0).all()):
        raise ValueError("sample: probabilities sum to zero")
    # First index with cdf > u*total: a zero-prob token never owns a CDF step.
    idx = torch.searchsorted(cdf, u.to(torch.float64)[:, None] * total, right=True).squeeze(1)   # [R]
    past = idx >= probs.shape[-1]
    if bool(past.any()):  # rounding at u -> 1: take the last token with mass
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)              # [R]
        idx = torch.where(past, last, idx)
    return idx


def sample(probs: Tensor, u: float) -> int:
    """Inverse-CDF draw from a 1-D prob vector [V] with uniform u in [0, 1)."""
    if probs.dim() != 1:
        raise ValueError(f"sample expects a 1-D prob vector, got shape {tuple(probs.shape)}")
    return int(sample_rows(probs[None], torch.tensor([u], dtype=torch.float64))[0])


def truncate_top_n(probs: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """1-D probs [V] -> (ids [m] int64, probs [m] float32): top-n nonzero, renormalised, m <= n."""
    vals, ids = torch.sort(probs.to(torch.float64), descending=True, stable=True)      # [V]
    vals, ids = vals[:n], ids[:n]                                                       # [n]
    nz = vals > 0
    vals, ids = vals[nz], ids[nz]                                                       # [m]
    if vals.numel() == 0:
        raise ValueError("truncate_top_n: no token with nonzero probability")
    return ids.to(torch.int64), (vals / vals.sum()).to(torch.float32)
