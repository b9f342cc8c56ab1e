"""Conversions between protobuf messages and the plain types the engines use.

Protobuf stays at the edges: servicers and clients call these, engines never
see a message. The orchestrator never converts a proposal at all: it reads the
few numbers the rule needs (`draft_probs`) and forwards the draft's messages
to the verifier as they came.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from specmesh.errors import InvalidArgument
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from specmesh.v1 import draft_pb2, sampling_pb2


def sampling_from_pb(msg: sampling_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """The parameters, checked where every service reads them: INVALID_ARGUMENT names the field."""
    if not (msg.temperature >= 0 and math.isfinite(msg.temperature)):   # also rejects NaN
        raise InvalidArgument(f"{field}.temperature", f"must be a finite number >= 0, got {msg.temperature}")
    if msg.top_k < 0:
        raise InvalidArgument(f"{field}.top_k", f"must be >= 0 (0 disables), got {msg.top_k}")
    if msg.HasField("top_p") and not 0 < msg.top_p <= 1:
        raise InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {msg.top_p}")
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k,
                          top_p=msg.top_p if msg.HasField("top_p") else 1.0)


def sampling_to_pb(params: SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def proposal_to_pb(proposal: DraftProposal) -> draft_pb2.DraftProposal:
    return draft_pb2.DraftProposal(token_id=proposal.token_id, q_ids=proposal.q_ids.tolist(),
                                   q_probs=proposal.q_probs.tolist())


def parents(proposals: Sequence[DraftProposal]) -> list[int]:
    """ProposeResponse.parents: empty for a chain; for a tree, each proposal's parent index (-1: the root)."""
    if all(p.parent is None for p in proposals):
        return []
    return [i - 1 if p.parent is None else p.parent for i, p in enumerate(proposals)]


def proposal_from_pb(msg: draft_pb2.DraftProposal) -> DraftProposal:
    return DraftProposal(msg.token_id, torch.tensor(msg.q_ids, dtype=torch.long),
                         torch.tensor(msg.q_probs, dtype=torch.float32))


def draft_probs(proposals: Sequence[draft_pb2.DraftProposal]) -> list[float]:
    """q_i(x_i) of each proposal, read off the message (0 when x_i is outside its own q)."""
    probs = []
    for p in proposals:
        ids = list(p.q_ids)
        probs.append(p.q_probs[ids.index(p.token_id)] if p.token_id in ids else 0.0)
    return probs
