"""gRPC edge of the draft tier: decode, call the engine on its thread, encode."""
from __future__ import annotations

from specmesh import wire
from specmesh.config import OrchestratorConfig
from specmesh.errors import InvalidArgument
from specmesh.server import EngineHost
from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specmesh.v1.Draft"
DEFAULT_TOP_N = OrchestratorConfig.draft_top_n   # when a caller leaves top_n unset


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, host: EngineHost):
        self.host = host

    async def Propose(self, request, context):
        if not request.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        proposals, cached_len = await self.host.call(
            "propose", request.session_id, request.sync.start, list(request.sync.token_ids), request.k,
            request.drafter, wire.sampling_from_pb(request.sampling), request.seed, request.top_n or DEFAULT_TOP_N)
        return draft_pb2.ProposeResponse(tokens=[wire.proposal_to_pb(p) for p in proposals], cached_len=cached_len)

    async def Release(self, request, context):
        released = await self.host.call("release", request.session_id)
        return cache_pb2.ReleaseResponse(released=released)

    async def Info(self, request, context):
        engine = self.host.require()
        drafters = [draft_pb2.DrafterInfo(name=name, model=d.model_name, vocab_size=d.vocab_size,
                                          vocab_fingerprint=d.vocab_fingerprint, max_context=d.max_context)
                    for name, d in sorted(engine.drafters.items())]
        return draft_pb2.DraftInfo(drafters=drafters, default_drafter=engine.default_drafter, max_k=engine.max_k)
