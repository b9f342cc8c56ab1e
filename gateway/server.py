"""`specmesh serve gateway`: uvicorn serving the gateway app.

It starts answering at once; /health says 503 until the orchestrator is
SERVING, so a load balancer sends traffic only once requests can succeed.
SIGTERM stops accepting connections and lets open streams finish (uvicorn's
graceful shutdown, bounded by `shutdown_grace_s`).
"""
from __future__ import annotations

import logging
import signal
import sys

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
        timeout_keep_alive=30,
        # HTTPS when given a certificate (uvicorn's own TLS; a TLS-terminating ingress in front is as good).
        ssl_certfile=config.tls_cert_file, ssl_keyfile=config.tls_key_file)


def serve(config: GatewayConfig) -> None:
    scheme = "https" if config.https() else "http"
    log.info("gateway on %s://%s:%d/v1 -> orchestrator %s", scheme, config.host, config.http_port,
             config.orchestrator_addr)
    # uvicorn handles SIGTERM itself (stop accepting, let open streams finish), then re-raises it to the
    # handler it found: make that one a clean exit, so a drained gateway ends with 0 like the gRPC tiers.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    uvicorn.Server(uvicorn_config(config)).run()
