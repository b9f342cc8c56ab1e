"""Sampling math for distributed speculative decoding.

Implements speculative sampling as in Leviathan, Kalman & Matias, "Fast Inference
from Transformers via Speculative Decoding" (arXiv 2211.17192, Algorithm 1) and
Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (arXiv 2302.01318, Algorithm 2), split so that nothing of size vocab
crosses the wire:

* the draft service samples x_i from its processed distribution q_i truncated to
  its top-n support (still a valid proposal, so the rule stays exact) and sends
  (x_i, q_ids_i, q_probs_i);
* the verifier computes the target distributions p_i and returns ``Scores``:
  p_i(x_i), a recovered token from norm(max(0, p_i - q_i)) and one bonus token;
* the orchestrator accepts x_i iff u < p_i(x_i) / q_i(x_i)
  (``orchestrator.acceptance.accept``).

Glossary (used throughout the project):

* **draft tokens** -- the k tokens x_1..x_k proposed by the draft for one step.
* **accepted** -- the draft tokens that passed the rule, always a prefix x_1..x_a.
* **recovered** -- the token drawn from norm(max(0, p_i - q_i)) at the first
  rejected position i; it replaces x_i.
* **bonus** -- the token drawn from p_{k+1} when all k draft tokens are accepted.
* **committed** -- what a step appends to the sequence: the accepted draft tokens
  plus exactly one recovered or bonus token.

Randomness is counter-based: every draw uses ``uniform(seed, position, stream)``
where position is the absolute index (prompt + generated) of the token being
chosen, so a seeded session reproduces across processes and replicas.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = [
    "Stream", "SamplingParams", "uniform", "process_logits", "sample",
    "truncate_top_n", "draft_token", "residual", "Scores", "score_draft",
]


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


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int, stream: Stream) -> float:
    """Uniform in [0, 1): splitmix64 chain of (seed, position, stream), 53-bit mantissa."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (position & _MASK64))
    h = _splitmix64(h ^ int(stream))
    return (h >> 11) * (1.0 / (1 << 53))


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] float32 probs: temperature, top-k, top-p, softmax.

    Greedy gives a one-hot at the argmax (ties -> lowest id). Ties at the top-k /
    top-p boundary are broken towards the lowest id, so exactly top_k tokens remain.
    """
    V = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), V).to(torch.float32)  # [..., V]
    x = logits.to(torch.float32) / params.temperature                                  # [..., V]
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


def sample(probs: Tensor, u: float) -> int:
    """Inverse-CDF draw from a 1-D prob vector [V] with uniform u in [0, 1)."""
    if probs.dim() != 1:
        raise ValueError(f"sample expects a 1-D prob vector, got shape {tuple(probs.shape)}")
    cdf = probs.to(torch.float64).cumsum(0)                                             # [V]
    total = cdf[-1]
    if not total > 0:
        raise ValueError("sample: probabilities sum to zero")
    # First index with cdf > u*total: a zero-prob token never owns a CDF step.
    idx = int(torch.searchsorted(cdf, (u * total).reshape(1), right=True).item())
    if idx >= probs.shape[0]:  # rounding at u -> 1: take the last token with mass
        idx = int(torch.nonzero(probs > 0)[-1].item())
    return idx


def truncate_top_n(probs: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """1-D probs [V] -> (ids [m] int64, probs [m] float32): top-n nonzero, renormalised, m <= n."""
    vals, ids = torch.sort(probs.to(torch.float64), descending=True, stable=True)      # [V]
    vals, ids = vals[:n], ids[:n]                                                       # [n]
    nz = vals > 0
    vals, ids = vals[nz], ids[nz]                                                       # [m]
    if vals.numel() == 0:
        raise ValueError("truncate_top_n: no token with nonzero probability")
    return ids.to(torch.int64), (vals / vals.sum()).to(torch.float32)


def draft_token(probs: Tensor, n: int, seed: int, position: int) -> tuple[int, Tensor, Tensor]:
    """Truncate q [V] to its top-n and sample from it with Stream.DRAFT -> (token, q_ids, q_probs)."""
    q_ids, q_probs = truncate_top_n(probs, n)                                          # [m], [m]
    j = sample(q_probs, uniform(seed, position, Stream.DRAFT))
    return int(q_ids[j].item()), q_ids, q_probs


def residual(p: Tensor, q_ids: Tensor, q_probs: Tensor) -> Tensor:
    """norm(max(0, p - q)) as [V] float32, q given sparsely; p itself when the mass is 0."""
    r = p.to(torch.float64).clone()                                                     # [V]
    r.index_add_(0, q_ids.to(device=p.device, dtype=torch.int64),
                 -q_probs.to(device=p.device, dtype=torch.float64))
    r.clamp_(min=0.0)
    total = r.sum()
    if not total > 0:
        return p.to(torch.float32)
    return (r / total).to(torch.float32)


@dataclass(frozen=True)
class Scores:
    """What the verifier returns for one Verify."""
    target_probs: list[float]     # p_i(x_i), len k
    recovered_tokens: list[int]   # draw from norm(max(0, p_i - q_i)), len k
    bonus_token: int              # draw from p_{k+1}


def score_draft(target_probs: Tensor, draft_tokens: Sequence[int], q_ids: Sequence[Tensor],
                q_probs: Sequence[Tensor], seed: int, start_position: int) -> Scores:
    """Verifier side. target_probs: [k+1, V], row i for absolute position start_position + i,
    where draft token i also sits."""
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k+1, V] with k={k}, got {tuple(target_probs.shape)}")
    if len(q_ids) != k or len(q_probs) != k:
        raise ValueError("q_ids and q_probs need one entry per draft token")
    toks = torch.as_tensor(list(draft_tokens), dtype=torch.int64, device=target_probs.device)  # [k]
    p_x = target_probs[torch.arange(k, device=target_probs.device), toks]                       # [k]
    recovered = [
        sample(residual(target_probs[i], q_ids[i], q_probs[i]),
               uniform(seed, start_position + i, Stream.TARGET))
        for i in range(k)
    ]
    bonus = sample(target_probs[k], uniform(seed, start_position + k, Stream.TARGET))
    return Scores(target_probs=[float(v) for v in p_x.tolist()],
                  recovered_tokens=recovered, bonus_token=bonus)
