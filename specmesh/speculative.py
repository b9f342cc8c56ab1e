"""Speculative sampling: the whole rule, in the order a step runs it.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (arXiv 2211.17192, Algorithm 1); Chen et al., "Accelerating Large
Language Model Decoding with Speculative Sampling" (arXiv 2302.01318,
Algorithm 2). Split across the tiers so that nothing of vocabulary size crosses
the wire:

1. draft service: `draft_token` samples x_i from its processed q_i truncated to
   the top-n support (a truncated q is still a valid proposal, so the rule
   stays exact) and sends (x_i, q_ids_i, q_probs_i);
2. verifier: `score_draft` computes the target's p_i and returns `Scores`:
   p_i(x_i), a recovered token drawn from norm(max(0, p_i - q_i)) at each
   position, and the bonus token drawn from p_{k+1};
3. orchestrator: `accept` keeps x_i while u < p_i(x_i) / q_i(x_i), then commits
   the recovered token at the first rejection, or the bonus token if all pass.
   Greedy needs no special case: p and q are one-hot, so p/q is 0 or 1 and the
   rule keeps the longest prefix matching the target's argmax, then its argmax.

Glossary, used the same way in the protos, the code, the metrics and the docs:

* **draft tokens**: the k tokens x_1..x_k the draft proposes for one step; each
  travels as a *proposal* (the token and the truncated q it was sampled from).
* **accepted**: the draft tokens that passed the rule, always a prefix x_1..x_a.
* **recovered**: the token drawn from norm(max(0, p_i - q_i)) at the first
  rejected position i; it replaces x_i.
* **bonus**: the token drawn from p_{k+1} when all k draft tokens are accepted
  (with no draft tokens, k = 0, it is the one token a plain target step makes).
* **committed**: what a step appends to the sequence: the accepted draft tokens
  plus exactly one recovered or bonus token.

Draft trees (specmesh.tree) use the same three steps with point-mass proposals:
`score_tree` gives p at each node's position and one end token per node (a
draw from p after it, its children taken out); `accept_tree` walks down from
the root, trying each node's children in order, the j-th accepted with
probability p(x_j) / (1 - p(x_1) - ... - p(x_{j-1})), and commits the path and
the end token of the node it stops at. Trying point masses one after another
this way is exact (each rejection takes that token out of p, as the chain
rule's residual does), so the committed tokens are distributed as the
target's. Greedy: the walk follows the target's argmax while a child matches.

Every draw is `uniform(seed, position, stream)` (`specmesh.sampling`), each rule
step on its own stream, so a seeded session reproduces whatever serves it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specmesh import tree
from specmesh.sampling import Stream, sample, truncate_top_n, uniform

__all__ = ["draft_token", "residual", "Scores", "score_draft", "Acceptance", "accept", "TreeScores", "score_tree",
           "accept_tree"]


# ---------------------------------------------------------------- 1. the draft


def draft_token(probs: Tensor, n: int, seed: int, position: int) -> tuple[int, Tensor, Tensor]:
    """Truncate q [V] to its top-n and sample from it with Stream.DRAFT -> (token, q_ids, q_probs)."""
    q_ids, q_probs = truncate_top_n(probs, n)                                          # [m], [m]
    j = sample(q_probs, uniform(seed, position, Stream.DRAFT))
    return int(q_ids[j].item()), q_ids, q_probs


# ---------------------------------------------------------------- 2. the verifier


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


# ---------------------------------------------------------------- 3. the orchestrator


@dataclass(frozen=True)
class Acceptance:
    accepted: int             # number of draft tokens accepted (0..k)
    tokens: list[int]         # the committed tokens: accepted draft tokens + one recovered or bonus token
    bonus: bool               # True when all k passed


def accept(draft_tokens: Sequence[int], draft_probs: Sequence[float], scores: Scores,
           seed: int, start_position: int) -> Acceptance:
    """Accept a prefix of the draft tokens, then commit one recovered or bonus token.

    draft_probs[i] = q_i(x_i), the truncated-q probability x_i was sampled with;
    draft token i sits at absolute position start_position + i.
    """
    k = len(draft_tokens)
    if not (len(draft_probs) == len(scores.target_probs) == len(scores.recovered_tokens) == k):
        raise ValueError("draft_tokens, draft_probs and scores must all have length k")
    for i in range(k):
        q = draft_probs[i]
        if not q > 0:
            raise ValueError(f"draft token {i} has q(x) = {q}; a sampled token needs q(x) > 0")
        if not uniform(seed, start_position + i, Stream.ACCEPT) < scores.target_probs[i] / q:
            return Acceptance(i, [*draft_tokens[:i], scores.recovered_tokens[i]], False)
    return Acceptance(k, [*draft_tokens, scores.bonus_token], True)


# ---------------------------------------------------------------- draft trees


@dataclass(frozen=True)
class TreeScores:
    """What the verifier returns for a draft tree."""
    target_probs: list[float]     # p(x_i) at node i's position (its parent's row), len k
    end_tokens: list[int]         # [0]: ending at the root, [i + 1]: ending at node i; len k + 1


def score_tree(target_probs: Tensor, draft_tokens: Sequence[int], parents: Sequence[int], seed: int,
               start_position: int, greedy: bool = False) -> TreeScores:
    """Verifier side. target_probs: [k+1, V], row 0 after the last committed token (the root), row i + 1
    after node i; node i sits at absolute position start_position + depth(i).

    `greedy`: the rows are one-hot (process_logits under greedy sampling). Then every end token is its
    row's hot token, which is what the draw below gives: with the children taken out, either the row is
    unchanged or it is empty and falls back to itself. Skipping the draws saves ~0.4 ms a step."""
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k+1, V] with k={k}, got {tuple(target_probs.shape)}")
    rows = torch.tensor([parent + 1 for parent in parents], dtype=torch.int64, device=target_probs.device)
    toks = torch.as_tensor(list(draft_tokens), dtype=torch.int64, device=target_probs.device)      # [k]
    p_x = target_probs[rows, toks] if k else target_probs.new_zeros(0)                              # [k]
    if greedy:
        return TreeScores([float(v) for v in p_x.tolist()], target_probs.argmax(dim=-1).tolist())
    depth = tree.depths(parents)
    ends = []
    for r, kids in enumerate(tree.children(parents)):
        p = target_probs[r].to(torch.float64).clone()                                              # [V]
        if kids:
            p[toks[kids]] = 0.0                 # the walk ends here only once every child was rejected
        if not p.sum() > 0:                     # the children held all the mass: never used
            p = target_probs[r].to(torch.float64)
        position = start_position + (depth[r - 1] + 1 if r else 0)   # the token drawn here sits after node r
        ends.append(sample(p, uniform(seed, position, Stream.TARGET)))
    return TreeScores([float(v) for v in p_x.tolist()], ends)


@dataclass(frozen=True)
class TreeAcceptance(Acceptance):
    path: list[int] = None        # the accepted nodes, root's child first


def accept_tree(draft_tokens: Sequence[int], parents: Sequence[int], scores: TreeScores, seed: int,
                start_position: int) -> TreeAcceptance:
    """Walk the tree from the root: at each node try its children in order, go down the first one
    accepted; commit the path and the end token of the node where no child was accepted."""
    k = len(draft_tokens)
    if not (len(parents) == len(scores.target_probs) == k and len(scores.end_tokens) == k + 1):
        raise ValueError("draft_tokens, parents and target_probs need k entries, end_tokens k + 1")
    kids = tree.children(parents)
    path: list[int] = []
    node = -1
    while True:
        position = start_position + len(path)        # where the children of `node` sit
        removed, chosen = 0.0, None
        for j, child in enumerate(kids[node + 1]):
            p = scores.target_probs[child]
            left = 1.0 - removed
            if left > 0 and uniform(seed, position, Stream.ACCEPT, j) < p / left:
                chosen = child
                break
            removed += p
        if chosen is None:
            break
        path.append(chosen)
        node = chosen
    tokens = [draft_tokens[i] for i in path] + [scores.end_tokens[node + 1]]
    return TreeAcceptance(len(path), tokens, not kids[node + 1], path)
