"""gRPC edge of the draft tier: decode, call the engine on its thread, encode."""
from __future__ import annotations

from specmesh import wire
from specmesh.engine_host import EngineHost
from specmesh.bounds import check_session_id
from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specmesh.v1.Draft"


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, host: EngineHost):
        self.host = host

    async def Propose(self, request, context):
        check_session_id(request.session_id)
        engine = self.host.require()
        proposals, cached_len = await self.host.run(
            engine.propose, request.session_id, request.sync.start, list(request.sync.token_ids), request.k,
            request.drafter, wire.sampling_from_pb(request.sampling), request.seed, request.top_n,
            request.sync.prefix_fingerprint, request.features,
            request.tree_min_confidence if request.HasField("tree_min_confidence") else None)
        return draft_pb2.ProposeResponse(proposals=[wire.proposal_to_pb(p) for p in proposals], cached_len=cached_len,
                                         parents=wire.parents(proposals))

    async def Release(self, request, context):
        check_session_id(request.session_id)
        engine = self.host.require()
        return cache_pb2.ReleaseResponse(released=await self.host.run_even_if_abandoned(
            engine.release, request.session_id))

    async def Info(self, request, context):
        engine = self.host.require()
        drafters = [draft_pb2.DrafterInfo(name=name, model=d.model_name, vocab_size=d.vocab_size,
                                          vocab_fingerprint=d.vocab_fingerprint, max_context=d.max_context,
                                          uses_target_features=d.uses_target_features, feature_dim=d.feature_dim)
                    for name, d in sorted(engine.drafters.items())]
        return draft_pb2.DraftInfo(drafters=drafters, default_drafter=engine.default_drafter, max_k=engine.max_k,
                                   cached_sessions=len(engine.sessions))
