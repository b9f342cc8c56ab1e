"""`specmesh serve verifier`: the target model behind the Verifier service."""
from __future__ import annotations

import asyncio
import logging

from specmesh.config import VerifierConfig
from specmesh.fast_linear import apply_kernels
from specmesh.models import load_model
from specmesh import auth, telemetry
from specmesh.engine_host import EngineHost
from specmesh.server import ServiceRuntime
from specmesh.v1 import verifier_pb2_grpc
from verifier_service.batching import VerifyBatcher
from verifier_service.engine import TargetEngine
from verifier_service.servicer import SERVICE_NAME, VerifierServicer
from verifier_service.verify_cost import measure_verify_cost

log = logging.getLogger("specmesh.verifier")


async def serve(config: VerifierConfig) -> None:
    runtime = ServiceRuntime.from_settings(
        [SERVICE_NAME], config, interceptors=auth.server_interceptors(internal_token_file=config.internal_token_file))
    host = EngineHost("target model", tier="verifier")
    telemetry.observe_engine("verifier", host)
    servicer = VerifierServicer(host, VerifyBatcher(host, config.max_batch, config.batch_window_ms / 1000))
    await runtime.start(lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server))
    loaded = await host.load(load_model, config.model, device=config.device, dtype=config.dtype)
    await host.load(apply_kernels, loaded.model, config.linear_kernels, config.batch_invariant,
                    config.min_product_rows)
    engine = TargetEngine(loaded, config)
    engine.verify_cost = await host.load(measure_verify_cost, engine)
    host.engine = engine
    await runtime.set_serving(True)
    log.info("verifier SERVING %s on port %d", loaded.info.name, runtime.port)
    trimming = asyncio.ensure_future(host.give_back_memory_when_idle())   # resident memory back after load
    await runtime.run_until_stopped()
    trimming.cancel()
