"""`specmesh serve gateway`: uvicorn serving the gateway app.

It starts answering at once; /health says 503 until the orchestrator is
SERVING, so a load balancer sends traffic only once requests can succeed.
SIGTERM stops accepting connections and lets open streams finish (uvicorn's
graceful shutdown, bounded by `shutdown_grace_s`).
"""
from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from specmesh.config import GatewayConfig

log = logging.getLogger("specmesh.gateway")


def uvicorn_config(config: GatewayConfig) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(config), host=config.host, port=config.http_port, lifespan="on",
        http="httptools",   # the C parser (a dependency): h11, pure Python, adds ~1 ms to each request
        # specmesh.logs formats our records; uvicorn's own dictConfig would replace it.
        log_config=None, access_log=config.access_log,
        # A little past the streams' own grace (EventSourceResponse), so they end first and cleanly.
        timeout_graceful_shutdown=config.shutdown_grace_s + 5,
        # The SDKs keep connections open between requests; keep them long enough to be reused.
        timeout_keep_alive=30)


def serve(config: GatewayConfig) -> None:
    log.info("gateway on http://%s:%d/v1 -> orchestrator %s", config.host, config.http_port, config.orchestrator_addr)
    uvicorn.Server(uvicorn_config(config)).run()
