"""Draft trees: several continuations verified in one target forward pass.

A chain proposes x_1..x_k, each after the one before it. A tree proposes k
nodes, each after its *parent*: `parents[i]` is the index of node i's parent
among the nodes, or -1 for a child of the last committed token (the root).
Parents come before their children (`parents[i] < i`), and siblings are in
the order the acceptance rule tries them (most likely first). A chain is the
tree whose parents are -1, 0, 1, ..., k - 2.

The target reads a tree in one pass: each node attends to the committed
tokens, its ancestors and itself, and sits at position start + depth. The
nodes of the first chain (0, 1, ..., m - 1 while each is the child of the one
before) are also the cache a chain would have built, so a replica keeps them
past the pass; every other node's entries are dropped.

Used by the EAGLE drafter (which grows the tree), the verifier (which scores
it) and the orchestrator (which walks it: specmesh.speculative.accept_tree).
"""
from __future__ import annotations

from typing import Sequence

import torch

from specmesh.errors import InvalidArgument
from specmesh.models import custom_attention_mask


def check_parents(parents: Sequence[int], k: int, field: str = "parents") -> None:
    """A tree's parents, or INVALID_ARGUMENT naming the first one that does not describe a tree."""
    if len(parents) != k:
        raise InvalidArgument(field, f"{len(parents)} parents for {k} proposals; send one per proposal")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise InvalidArgument(f"{field}[{i}]", f"must be -1 (the root) or the index of an earlier proposal, "
                                                   f"got {parent}")


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 0 for a child of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def first_chain(parents: Sequence[int]) -> int:
    """m: nodes 0 .. m - 1 form a chain from the root (their cache entries are a chain's)."""
    m = 0
    while m < len(parents) and parents[m] == m - 1:
        m += 1
    return m


def children(parents: Sequence[int]) -> list[list[int]]:
    """children[r]: the nodes whose parent is r, in order; r = 0 is the root, r = i + 1 node i."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def feed_layout(tail: int, parents: Sequence[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fed block of one forward pass: `tail` committed tokens (causal), then the tree's nodes.

    Returns (offsets [T], allowed [T, T] bool) for T = tail + len(parents): each fed
    token's position relative to the first fed one, and which fed tokens it attends
    to (every cached token is always attended to; the caller prepends those columns).
    """
    k = len(parents)
    n = tail + k
    allowed = torch.zeros(n, n, dtype=torch.bool, device=device)
    allowed[:tail, :tail] = torch.ones(tail, tail, dtype=torch.bool, device=device).tril()   # causal
    allowed[tail:, :tail] = True                                                                # nodes see the tail
    offsets = list(range(tail))
    for i, (parent, depth) in enumerate(zip(parents, depths(parents))):
        row = tail + i
        if parent >= 0:
            allowed[row, tail:] = allowed[tail + parent, tail:]
        allowed[row, row] = True
        offsets.append(tail + depth)
    return torch.tensor(offsets, dtype=torch.long, device=device), allowed


def attention_mask(model, cached: int, tail: int, parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [1, T], 4D mask [1, 1, T, cached + T]) for `model`'s forward over a tree
    (specmesh.models.custom_attention_mask: the form its attention takes)."""
    offsets, allowed = feed_layout(tail, parents, model.device)
    full = torch.cat([torch.ones(len(offsets), cached, dtype=torch.bool, device=model.device), allowed], dim=1)
    return (offsets + cached)[None], custom_attention_mask(model, full[None, None])
