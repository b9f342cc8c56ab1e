"""`specmesh serve draft`: the drafters behind the Draft service."""
from __future__ import annotations

import asyncio
import logging

from specmesh.config import DraftConfig
from specmesh import auth, telemetry
from specmesh.engine_host import EngineHost
from specmesh.server import ServiceRuntime
from specmesh.v1 import draft_pb2_grpc
from draft_service.engine import DraftEngine
from draft_service.servicer import SERVICE_NAME, DraftServicer

log = logging.getLogger("specmesh.draft")


async def serve(config: DraftConfig) -> None:
    runtime = ServiceRuntime.from_settings(
        [SERVICE_NAME], config, interceptors=auth.server_interceptors(internal_token_file=config.internal_token_file))
    host = EngineHost("draft model", tier="draft")
    telemetry.observe_engine("draft", host)
    servicer = DraftServicer(host)
    await runtime.start(lambda server: draft_pb2_grpc.add_DraftServicer_to_server(servicer, server))
    host.engine = await host.load(DraftEngine.from_config, config)
    await runtime.set_serving(True)
    log.info("draft SERVING on port %d (drafters: %s)", runtime.port, ", ".join(sorted(host.engine.drafters)))
    trimming = asyncio.ensure_future(host.give_back_memory_when_idle())   # resident memory back after load
    await runtime.run_until_stopped()
    trimming.cancel()
