"""`specmesh serve orchestrator`: the public API in front of the draft and verifier tiers."""
from __future__ import annotations

import asyncio
import logging
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.decode import Decoder
from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.requests import Limits
from orchestrator.servicer import SERVICE_NAME, OrchestratorServicer
from orchestrator.sessions import SessionStore
from orchestrator.tree_cut import pooled, tree_min_confidence
from specmesh import auth, telemetry, tls
from specmesh.config import OrchestratorConfig
from specmesh.models import ModelInfo, VocabularyMismatch, check_same_vocab, load_tokenizer
from specmesh.server import ServiceRuntime
from specmesh.v1 import cache_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("specmesh.orchestrator")


async def when_serving(replica: Replica, service: str) -> None:
    """Wait until a replica's grpc.health.v1 reports SERVING (its model loaded): a Watch stream,
    held with wait_for_ready so a replica that is not up yet is waited for, not failed."""
    stub = health_pb2_grpc.HealthStub(replica.channel)
    while True:
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True)
        try:
            async for reply in watch:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                log.info("waiting for %s at %s (%s)", service, replica.address,
                         health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.aio.AioRpcError as error:   # the replica restarted mid-watch: watch again
            log.info("waiting for %s at %s (%s)", service, replica.address, error.code().name)
            await asyncio.sleep(1.0)   # an answered error (not a missing server) would otherwise repeat at once
        finally:
            # Leaving the loop does not end the call; until garbage collection did, the stream stayed open
            # on the replica and held its next graceful stop for the whole grace period (30 s).
            watch.cancel()


async def infos(pool: ReplicaPool, service: str) -> list:
    """Info from every replica of a pool, once each serves."""
    await asyncio.gather(*(when_serving(r, service) for r in pool.replicas))
    return list(await asyncio.gather(*(r.stub.Info(cache_pb2.InfoRequest(), timeout=30) for r in pool.replicas)))


def check_replicas(tokenizer_info: ModelInfo, verifier_infos, draft_infos) -> None:
    """Refuse to serve when the tiers disagree about the vocabulary."""
    for v in verifier_infos:
        if v.vocab_fingerprint != tokenizer_info.vocab_fingerprint:
            raise VocabularyMismatch(
                f"verifier model {v.model!r} (vocab {v.vocab_size}, fingerprint {v.vocab_fingerprint}) does not use "
                f"the orchestrator's tokenizer {tokenizer_info.name!r} (fingerprint {tokenizer_info.vocab_fingerprint})")
    target = verifier_infos[0]
    for d in draft_infos:
        for drafter in d.drafters:
            if drafter.vocab_fingerprint:   # empty: a vocabulary-agnostic drafter (n-gram)
                check_same_vocab(_info(drafter), _info(target))
            for v in verifier_infos:
                if drafter.uses_target_features and drafter.feature_dim != v.feature_dim:
                    raise VocabularyMismatch(
                        f"the {drafter.name} drafter ({drafter.model}) reads target features of width "
                        f"{drafter.feature_dim}, but verifier model {v.model!r} has features of width "
                        f"{v.feature_dim}: it was not made for this target")


def feature_drafters(draft_infos) -> dict[str, int]:
    """Drafters that read the target's features (EAGLE) -> their width."""
    return {d.name: d.feature_dim for i in draft_infos for d in i.drafters if d.uses_target_features}


def _info(msg) -> ModelInfo:
    return ModelInfo(msg.model, msg.vocab_size, msg.vocab_fingerprint, msg.max_context, ())


async def connect(config: OrchestratorConfig, servicer: OrchestratorServicer, sessions: SessionStore) -> None:
    tokenizer, info = await asyncio.to_thread(load_tokenizer, config.model)
    # With tracing on, client spans and the trace context; with an internal token, the token on every call.
    interceptors = [*telemetry.client_interceptors(),
                    *([auth.BearerToken(auth.read_token(config.internal_token_file))] if config.internal_token_file
                      else [])]
    drafts = ReplicaPool.connect("draft", config.draft_addrs, draft_pb2_grpc.DraftStub,
                                 interceptors=interceptors, retry_s=config.replica_retry_s,
                                 max_message_bytes=config.max_message_bytes, tls=config.channel_tls())
    verifiers = ReplicaPool.connect("verifier", config.verifier_addrs, verifier_pb2_grpc.VerifierStub,
                                    interceptors=interceptors, retry_s=config.replica_retry_s,
                                    max_message_bytes=config.max_message_bytes, tls=config.channel_tls())
    verifier_infos = await infos(verifiers, "specmesh.v1.Verifier")
    draft_infos = await infos(drafts, "specmesh.v1.Draft")
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
        max_prompt_tokens=config.max_prompt_tokens,
        max_total_tokens=config.max_total_tokens,
        max_stop_strings=config.max_stop_strings,
    )
    servicer.models = orchestrator_pb2.ListModelsResponse(
        target_model=verifier_infos[0].model, max_context=servicer.limits.max_context,
        drafters=[orchestrator_pb2.DrafterModel(name=d.name, model=d.model)
                  for d in draft_infos[0].drafters if d.name in drafters],
        default_drafter=default_drafter, default_k=config.default_k, max_k=servicer.limits.max_k)
    eos = set(info.eos_token_ids) | {t for v in verifier_infos for t in v.eos_token_ids}
    verify_cost = pooled([list(v.verify_cost) for v in verifier_infos])
    if verify_cost:
        log.info("draft trees cut at %.3f for requests of the default k = %d (a Verify of k draft tokens costs %s "
                 "of one of none, k = 0..%d)", tree_min_confidence(verify_cost, config.default_k), config.default_k,
                 " ".join(f"{c:.2f}" for c in verify_cost), len(verify_cost) - 1)
    servicer.decoder = Decoder(sessions, drafts, verifiers, tokenizer, eos, config.draft_top_n, config.rpc_timeout_s,
                               config.rpc_timeout_s_per_1k_tokens, feature_drafters(draft_infos), verify_cost)
    await sessions.client.ping()


async def serve(config: OrchestratorConfig) -> None:
    sessions = SessionStore.from_url(config.redis_url, config.session_ttl_s, os.environ.get("REDIS_PASSWORD"),
                                     config.redis_retry_s, finished_ttl_s=config.finished_ttl_s)
    servicer = OrchestratorServicer(sessions, config.max_active_sessions)
    runtime = ServiceRuntime.from_settings(
        [SERVICE_NAME], config, interceptors=auth.server_interceptors(tokens_file=config.auth_tokens_file))
    await runtime.start(lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server))
    await connect(config, servicer, sessions)
    await runtime.set_serving(True)
    health = asyncio.ensure_future(follow_redis(runtime, sessions))
    rotation = None
    if (channel_tls := config.channel_tls()) is not None:
        def reconnect() -> None:   # a renewed client certificate or CA: new channels, calls in flight finish
            servicer.decoder.drafts.reconnect(config.rpc_timeout_s)
            servicer.decoder.verifiers.reconnect(config.rpc_timeout_s)

        rotation = asyncio.ensure_future(tls.follow_rotation(channel_tls, reconnect))
    log.info("orchestrator SERVING on port %d (drafts: %s; verifiers: %s; redis: %s)", runtime.port,
             ",".join(config.draft_addrs), ",".join(config.verifier_addrs), _redacted(config.redis_url))
    await runtime.run_until_stopped()
    health.cancel()
    if rotation is not None:
        rotation.cancel()
    await servicer.decoder.drafts.close()
    await servicer.decoder.verifiers.close()
    await sessions.client.aclose()


async def follow_redis(runtime: ServiceRuntime, sessions: SessionStore, every_s: float = 1.0) -> None:
    """Health follows Redis: NOT_SERVING while it does not answer, so load balancers and
    probes send new streams elsewhere; SERVING again as soon as it does."""
    serving = True
    while not runtime.stopping:
        reachable = await sessions.reachable()
        if reachable != serving and not runtime.stopping:
            log.warning("redis %s: %s", "answers again" if reachable else "unreachable",
                        "SERVING" if reachable else "NOT_SERVING")
            await runtime.set_serving(reachable)
            serving = reachable
        await asyncio.sleep(every_s)


def _redacted(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url
