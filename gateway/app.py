"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions, /v1/models,
plus /health (the orchestrator's health), /ping (this process) and /metrics.

A completion is one Generate stream on the orchestrator. The gateway waits for
its first chunk (the session id, sent once the request is valid) before it
answers, so a rejected request gets its own status (400, 429, 503) rather than
a 200 stream that fails. A client that goes away cancels the gRPC call at once,
and the orchestrator releases the session's caches on the replicas.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.body_limit import BodyLimit
from gateway.errors import APIError, from_grpc, validation_param
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.translate import Reply, committed_tokens, generate_request
from gateway.upstream import Upstream
from specmesh.config import GatewayConfig

log = logging.getLogger("specmesh.gateway")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ping", "/metrics")
_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error"}


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def validation_error(error: ValidationError) -> APIError:
    first = error.errors(include_url=False)[0]
    if first["type"] in ("json_invalid", "json_type"):
        return APIError(400, f"the body is not valid JSON: {first['msg']}", "invalid_request_error", None,
                        "invalid_json")
    param = validation_param(tuple(first["loc"]))
    # Several union members may complain; one clear message is enough.
    return APIError(400, f"{param or 'body'}: {first['msg']}", "invalid_request_error", param,
                    "invalid_value" if first["type"] != "missing" else "missing_required_parameter")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Completions:
    """Both completion routes: parse, translate, call, answer (JSON or SSE)."""

    def __init__(self, upstream: Upstream, metrics: GatewayMetrics, sse_ping_s: float, shutdown_grace_s: float):
        self.upstream, self.metrics, self.sse_ping_s = upstream, metrics, sse_ping_s
        self.shutdown_grace_s = shutdown_grace_s

    async def __call__(self, request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        body = await request.body()   # 413 past max_body_bytes (BodyLimit)
        schema = ChatCompletionRequest if chat else CompletionRequest
        try:
            req = schema.model_validate_json(body)
        except ValidationError as error:
            raise validation_error(error) from None
        served = await self.upstream.served()
        msg = generate_request(req, served.resolve(req.model))
        if req.user:
            log.debug("request for user %r", req.user)   # the future tenant
        prompt_field = "messages" if chat else "prompt"
        max_tokens_field = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        call = self.upstream.generate(msg, request.headers.get("authorization"))
        try:
            first = await call.read()   # the session id, once the orchestrator has accepted the request
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, prompt_field, max_tokens_field) from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise APIError(502, "the orchestrator ended the stream without a reply", "server_error", None,
                           "upstream_error")
        reply = Reply(chat=chat, model=req.model, created=int(time.time()))
        reply.add(first)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # On SIGTERM a stream gets shutdown_grace_s to finish; then it is cancelled (and so is its session).
            return EventSourceResponse(self._events(call, reply, include_usage, arrived), ping=self.sse_ping_s,
                                       sep="\n", shutdown_grace_period=self.shutdown_grace_s)
        return await self._collect(request, call, reply, prompt_field, max_tokens_field)

    async def _collect(self, request: Request, call, reply: Reply, prompt_field: str, max_tokens_field: str
                       ) -> Response:
        """Read the whole stream, unless the client leaves first (then cancel it)."""
        async def read_all():
            while (chunk := await call.read()) is not grpc.aio.EOF:
                reply.add(chunk)

        reading = asyncio.ensure_future(read_all())
        watching = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait((reading, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not reading.done():   # the client left (or this task was cancelled): end the session
                call.cancel()
                reading.cancel()
                self.metrics.disconnects.add(1, {"tier": "gateway"})
        if not reading.done():
            # cancel() lands at the reader's next await: until then the task has no result (result() would
            # raise InvalidStateError, a 500, where the answer is 499).
            await asyncio.wait((reading,))
        try:
            reading.result()
        except asyncio.CancelledError:
            return Response(status_code=499)   # nobody is listening
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, prompt_field, max_tokens_field) from None
        self.metrics.committed.add(committed_tokens(reply.stats), {"tier": "gateway"})
        return JSONResponse(reply.response())

    async def _events(self, call, reply: Reply, include_usage: bool, arrived: float):
        """SSE data: OpenAI chunks, the usage chunk when asked, then [DONE]."""
        finished = False
        self.metrics.active.add(1, {"tier": "gateway"})
        try:
            if reply.chat:
                yield _dumps(reply.chunk(None, first=True, with_usage_field=include_usage))
            first_text = True
            while (chunk := await call.read()) is not grpc.aio.EOF:
                reply.add(chunk)
                if chunk.text:
                    yield _dumps(reply.chunk(chunk.text, with_usage_field=include_usage))
                    if first_text:
                        self.metrics.ttft.record(time.perf_counter() - arrived, {"tier": "gateway"})
                        first_text = False
                if chunk.finish_reason:
                    yield _dumps(reply.chunk(None, reply.finish, with_usage_field=include_usage))
            if include_usage:
                yield _dumps(reply.usage_chunk())
            yield "[DONE]"
            finished = True
        except grpc.aio.AioRpcError as error:
            # The status line is long gone: an error event, as OpenAI sends (the SDKs raise it).
            yield _dumps(from_grpc(error).body())
            finished = True
        finally:
            if not finished:   # the client went away (sse-starlette cancelled us): end the session now
                call.cancel()
                self.metrics.disconnects.add(1, {"tier": "gateway"})
            self.metrics.active.add(-1, {"tier": "gateway"})
            self.metrics.committed.add(committed_tokens(reply.stats), {"tier": "gateway"})
            self.metrics.duration.record(time.perf_counter() - arrived, {"tier": "gateway", "stream": "true"})


class _RecordStatus:
    """ASGI middleware: count every answer by route and status (the metric the HPA and alerts read)."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def capture(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in ROUTES else "other", status)


def create_app(config: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The channel belongs to the server's event loop, so it is made here, not at import.
        app.state.upstream = Upstream(config.orchestrator_addr, config.request_timeout_s, config.served_model_name,
                                        tls=config.channel_tls())
        app.state.completions = Completions(app.state.upstream, metrics, config.sse_ping_s, config.shutdown_grace_s)
        yield
        await app.state.upstream.close()
        metrics.shutdown()

    app = FastAPI(title="specmesh gateway", summary="OpenAI-compatible HTTP API in front of the orchestrator",
                  lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(_RecordStatus, metrics=metrics)
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = str(error.detail)
        kind = _STATUS_TYPES.get(error.status_code, "invalid_request_error")
        return JSONResponse(APIError(error.status_code, message, kind).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unhandled error on %s", request.url.path, exc_info=error)
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}", "server_error").body(),
                            status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await request.app.state.completions(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await request.app.state.completions(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        served = await request.app.state.upstream.served()
        return served.models_list(created=int(time.time()))

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        served = await request.app.state.upstream.served()
        served.resolve(model)   # 404 for one we do not serve
        return next(m for m in served.models_list(created=int(time.time()))["data"] if m["id"] == model)

    @app.get("/health")
    async def health(request: Request):
        """Readiness: 200 while the orchestrator is SERVING (the chart's readiness probe)."""
        if await request.app.state.upstream.healthy():
            return {"status": "ok", "orchestrator": "SERVING"}
        return JSONResponse({"status": "unavailable", "orchestrator": "NOT_SERVING"}, status_code=503)

    @app.get("/ping")
    async def ping():
        """Liveness: this process answers, whatever the orchestrator's state (so it is not restarted for it)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.scrape(), media_type=CONTENT_TYPE)

    return app
