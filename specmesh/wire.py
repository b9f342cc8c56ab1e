"""Conversions between protobuf messages and the plain types the engines use.

Protobuf stays at the edges: servicers and clients call these, engines never
see a message.
"""
from __future__ import annotations

import torch

from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from specmesh.v1 import draft_pb2, sampling_pb2


def sampling_from_pb(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k,
                          top_p=msg.top_p if msg.HasField("top_p") else 1.0)


def sampling_to_pb(params: SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def proposal_to_pb(proposal: DraftProposal) -> draft_pb2.DraftToken:
    return draft_pb2.DraftToken(token_id=proposal.token_id, q_ids=proposal.q_ids.tolist(),
                                q_probs=proposal.q_probs.tolist())


def proposal_from_pb(msg: draft_pb2.DraftToken) -> DraftProposal:
    return DraftProposal(msg.token_id, torch.tensor(msg.q_ids, dtype=torch.long),
                         torch.tensor(msg.q_probs, dtype=torch.float32))
