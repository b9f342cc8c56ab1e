"""`specmesh serve orchestrator`: the public API in front of the draft and verifier tiers."""
from __future__ import annotations

import asyncio
import logging

import grpc

from orchestrator.decode import Decoder
from orchestrator.replicas import ReplicaPool
from orchestrator.requests import Limits
from orchestrator.servicer import SERVICE_NAME, OrchestratorServicer
from orchestrator.sessions import SessionStore
from specmesh import telemetry
from specmesh.config import OrchestratorConfig
from specmesh.models import VocabularyMismatch, load_tokenizer
from specmesh.server import ServiceRuntime
from specmesh.v1 import cache_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("specmesh.orchestrator")


async def _ask_until_answered(pool: ReplicaPool, what: str, retry_s: float = 1.0):
    """Info from every replica of a pool, waiting for replicas still loading their models."""
    answers = []
    for replica in pool.replicas:
        while True:
            try:
                answers.append(await replica.stub.Info(cache_pb2.InfoRequest(), timeout=5))
                break
            except grpc.aio.AioRpcError as error:
                log.info("waiting for %s %s (%s)", what, replica.address, error.code().name)
                await asyncio.sleep(retry_s)
    return answers


def check_replicas(tokenizer_info, verifier_infos, draft_infos) -> None:
    """Refuse to serve when the tiers disagree about the vocabulary."""
    for v in verifier_infos:
        if v.vocab_fingerprint != tokenizer_info.vocab_fingerprint:
            raise VocabularyMismatch(
                f"verifier model {v.model!r} (vocab {v.vocab_size}, fingerprint {v.vocab_fingerprint}) does not use "
                f"the orchestrator's tokenizer {tokenizer_info.name!r} (fingerprint {tokenizer_info.vocab_fingerprint})")
    for d in draft_infos:
        for drafter in d.drafters:
            if drafter.vocab_fingerprint and drafter.vocab_fingerprint != tokenizer_info.vocab_fingerprint:
                raise VocabularyMismatch(
                    f"draft model {drafter.model!r} (vocab {drafter.vocab_size}, fingerprint "
                    f"{drafter.vocab_fingerprint}) does not share the target's vocabulary ({tokenizer_info.name!r}, "
                    f"vocab {tokenizer_info.vocab_size}, fingerprint {tokenizer_info.vocab_fingerprint}); "
                    f"speculative decoding needs a draft with the target's tokenizer")


async def connect(config: OrchestratorConfig, servicer: OrchestratorServicer, sessions: SessionStore) -> None:
    tokenizer, info = await asyncio.to_thread(load_tokenizer, config.model)
    # With tracing on, client spans for Propose / Verify and the trace context in their metadata.
    drafts = ReplicaPool.connect("draft", config.draft_addrs, draft_pb2_grpc.DraftStub,
                                 interceptors=telemetry.client_interceptors(), retry_s=config.replica_retry_s)
    verifiers = ReplicaPool.connect("verifier", config.verifier_addrs, verifier_pb2_grpc.VerifierStub,
                                    interceptors=telemetry.client_interceptors(), retry_s=config.replica_retry_s)
    verifier_infos = await _ask_until_answered(verifiers, "verifier")
    draft_infos = await _ask_until_answered(drafts, "draft")
    check_replicas(info, verifier_infos, draft_infos)
    # Every draft replica must serve what a request may name.
    drafters = frozenset.intersection(*(frozenset(d.name for d in i.drafters) for i in draft_infos))
    default_drafter = config.default_drafter or draft_infos[0].default_drafter
    servicer.limits = Limits(
        max_context=min(v.max_context for v in verifier_infos),
        vocab_size=min(v.vocab_size for v in verifier_infos),
        max_k=min([config.max_k] + [i.max_k for i in draft_infos]),
        default_k=config.default_k,
        default_max_new_tokens=config.default_max_new_tokens,
        drafters=drafters,
        default_drafter=default_drafter,
        drafter_context={d.name: min(x.max_context for i in draft_infos for x in i.drafters if x.name == d.name)
                         for d in draft_infos[0].drafters if d.max_context},
    )
    servicer.models = orchestrator_pb2.ListModelsResponse(
        target_model=verifier_infos[0].model, max_context=servicer.limits.max_context,
        drafters=[orchestrator_pb2.DrafterModel(name=d.name, model=d.model)
                  for d in draft_infos[0].drafters if d.name in drafters],
        default_drafter=default_drafter, default_k=config.default_k, max_k=servicer.limits.max_k)
    eos = set(info.eos_token_ids) | {t for v in verifier_infos for t in v.eos_token_ids}
    servicer.decoder = Decoder(sessions, drafts, verifiers, tokenizer, eos, config.draft_top_n, config.rpc_timeout_s)
    await sessions.client.ping()


async def serve(config: OrchestratorConfig) -> None:
    sessions = SessionStore.from_url(config.redis_url, config.session_ttl_s)
    servicer = OrchestratorServicer(sessions, config.max_active_sessions)
    runtime = ServiceRuntime([SERVICE_NAME], config.port)
    await runtime.start(lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server))
    await connect(config, servicer, sessions)
    await runtime.set_serving(True)
    log.info("orchestrator SERVING on port %d (drafts: %s; verifiers: %s; redis: %s)", runtime.port,
             ",".join(config.draft_addrs), ",".join(config.verifier_addrs), _redacted(config.redis_url))
    await runtime.run_until_stopped()
    await servicer.decoder.drafts.close()
    await servicer.decoder.verifiers.close()
    await sessions.client.aclose()


def _redacted(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url
