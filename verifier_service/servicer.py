"""gRPC edge of the verifier: decode, call the engine on its thread, encode."""
from __future__ import annotations

from specmesh import wire
from specmesh.engine_host import EngineHost
from specmesh.bounds import check_session_id
from specmesh.eagle import features_to_bytes
from specmesh.speculative import TreeScores
from specmesh.v1 import cache_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.batching import VerifyBatcher
from verifier_service.engine import VerifyCall

SERVICE_NAME = "specmesh.v1.Verifier"


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, host: EngineHost, batcher: VerifyBatcher | None = None):
        self.host = host
        self.batcher = batcher or VerifyBatcher(host, max_batch=1)

    async def Prefill(self, request, context):
        check_session_id(request.session_id)
        engine = self.host.require()
        cached_len, features = await self.host.run(engine.prefill, request.session_id, list(request.token_ids),
                                                   request.return_features)
        return verifier_pb2.PrefillResponse(
            cached_len=cached_len, features=features_to_bytes(features) if features is not None else b"")

    async def Verify(self, request, context):
        check_session_id(request.session_id)
        self.host.require()
        verified = await self.batcher.submit(VerifyCall(
            request.session_id, request.sync.start, list(request.sync.token_ids),
            [wire.proposal_from_pb(p) for p in request.proposals], wire.sampling_from_pb(request.sampling),
            request.seed, request.sync.prefix_fingerprint, request.return_features, list(request.parents)))
        scores = verified.scores
        if isinstance(scores, TreeScores):
            reply = verifier_pb2.VerifyResponse(target_probs=scores.target_probs, end_tokens=scores.end_tokens,
                                                cached_len=verified.cached_len)
        else:
            reply = verifier_pb2.VerifyResponse(target_probs=scores.target_probs,
                                                recovered_tokens=scores.recovered_tokens,
                                                bonus_token=scores.bonus_token, cached_len=verified.cached_len)
        if verified.features is not None:
            reply.features, reply.features_start = features_to_bytes(verified.features), verified.features_start
        return reply

    async def Release(self, request, context):
        check_session_id(request.session_id)
        engine = self.host.require()
        return cache_pb2.ReleaseResponse(released=await self.host.run_even_if_abandoned(
            engine.release, request.session_id))

    async def Info(self, request, context):
        engine = self.host.require()
        info = engine.info
        return verifier_pb2.VerifierInfo(model=info.name, vocab_size=info.vocab_size,
                                         vocab_fingerprint=info.vocab_fingerprint, max_context=info.max_context,
                                         eos_token_ids=list(info.eos_token_ids), cached_sessions=len(engine.sessions),
                                         feature_dim=engine.feature_dim, verify_cost=engine.verify_cost)
