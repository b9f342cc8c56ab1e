"""What every specmesh gRPC service shares: the server, health, reflection,
the one interceptor that maps errors to statuses, and graceful shutdown.

A service registers its servicer, starts NOT_SERVING, loads its model, flips
to SERVING, and on SIGTERM/SIGINT flips back to NOT_SERVING, stops accepting
calls and gives in-flight ones `grace_s` to finish before they are cancelled.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmesh import telemetry
from specmesh.bounds import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from specmesh.errors import ServiceError
from specmesh.tls import ServerTLS, server_credentials

log = logging.getLogger("specmesh.server")

# Status details echo parts of a request; a client refuses trailers past its metadata limit
# (8 KiB by default), which would turn a clean status into an opaque one.
MAX_DETAILS_CHARS = 1024


@dataclass(frozen=True)
class Undecodable:
    """What a request becomes when its bytes do not parse as the method's message
    (corrupt wire format, invalid UTF-8 in a string field)."""

    problem: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """gRPC runs the deserializer before any handler, and turns what it raises into UNKNOWN.
    Returning the failure as a value lets the handler's wrapper answer INVALID_ARGUMENT."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as error:  # noqa: BLE001 - DecodeError, or whatever a custom deserializer raises
            return Undecodable(f"{type(error).__name__}: {error}")

    return deserialize


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Turns ServiceError into its gRPC status, a request that does not decode into
    INVALID_ARGUMENT, and anything else into INTERNAL.

    `on_status(method, code)` is called once per finished call (metrics hook).
    """

    def __init__(self, on_status: Callable[[str, grpc.StatusCode], None] = telemetry.record_rpc_status):
        self._on_status = on_status

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            # Ours yield their replies; some library servicers (health's Watch) write them with context.write.
            wrap = self._wrap_stream if inspect.isasyncgenfunction(handler.unary_stream) else self._wrap_unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(method, handler.unary_stream),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:   # server reflection
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_request_stream(method, handler.stream_stream),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_request_stream(method, handler.stream_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _fail(self, method: str, context: grpc.aio.ServicerContext, error: BaseException):
        if isinstance(error, ServiceError):
            code, message = error.code, error.message
        else:
            log.exception("unhandled error in %s", method, exc_info=error)
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
        self._on_status(method, code)
        if len(message) > MAX_DETAILS_CHARS:
            message = message[:MAX_DETAILS_CHARS] + "..."
        await context.abort(code, message)

    async def _refuse_undecodable(self, method: str, context: grpc.aio.ServicerContext, request) -> None:
        if isinstance(request, Undecodable):
            self._on_status(method, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {method.rsplit('/', 1)[-1]} message ({request.problem})"
                                [:MAX_DETAILS_CHARS])

    def _wrap_unary(self, method, behavior):
        async def wrapped(request, context):
            await self._refuse_undecodable(method, context, request)
            try:
                reply = await behavior(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:  # noqa: BLE001 - the point of this interceptor
                await self._fail(method, context, error)
            self._on_status(method, grpc.StatusCode.OK)
            return reply

        return wrapped

    def _wrap_stream(self, method, behavior):
        async def wrapped(request, context):
            await self._refuse_undecodable(method, context, request)
            try:
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:  # noqa: BLE001
                await self._fail(method, context, error)
            self._on_status(method, grpc.StatusCode.OK)

        return wrapped

    def _wrap_request_stream(self, method, behavior):
        """A library's request-streaming method (reflection): only undecodable requests are ours to map."""
        async def checked(requests, context):
            async for request in requests:
                await self._refuse_undecodable(method, context, request)
                yield request

        if inspect.isasyncgenfunction(behavior):
            async def wrapped(requests, context):
                async with contextlib.aclosing(behavior(checked(requests, context), context)) as items:
                    async for item in items:
                        yield item
        else:
            async def wrapped(requests, context):
                return await behavior(checked(requests, context), context)
        return wrapped


# SO_REUSEPORT off (gRPC turns it on): with it, a second server on a port already bound shares it and takes
# part of its connections (health checks included) instead of failing to start.
NO_PORT_SHARING = ("grpc.so_reuseport", 0)


class ServiceRuntime:
    """One gRPC server with health and reflection for the named services."""

    def __init__(self, service_names: Iterable[str], port: int, *, host: str = "[::]", grace_s: float = 30.0,
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ServerTLS | None = None):
        self.service_names = list(service_names)
        # Built now, so a missing or mismatched certificate stops start-up with its name, not the first handshake.
        self._credentials = server_credentials(tls) if tls is not None else None
        self.security = ("mutual TLS" if tls.client_ca_file else "TLS") if tls is not None else "plaintext"
        self.host, self.port, self.grace_s = host, port, grace_s
        # Tracing's interceptor (none when tracing is off) goes first: its span covers the status mapping.
        self.interceptors = [*telemetry.server_interceptors(), *interceptors,
                             StatusInterceptor()]
        self.server = grpc.aio.server(interceptors=self.interceptors,
                                      options=[*message_size_options(max_message_bytes), NO_PORT_SHARING])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._stopping = asyncio.Event()

    @classmethod
    def from_settings(cls, service_names: Iterable[str], config, interceptors=()) -> "ServiceRuntime":
        """A runtime for a tier's settings (specmesh.config.ServiceSettings): port, host, size limit, TLS."""
        return cls(service_names, config.port, host=config.host, interceptors=interceptors,
                   max_message_bytes=config.max_message_bytes, tls=config.server_tls())

    async def start(self, register: Callable[[grpc.aio.Server], None], descriptors: Iterable[str] = ()) -> int:
        register(self.server)
        reflection.enable_server_reflection([*descriptors, *self.service_names, reflection.SERVICE_NAME,
                                             health.SERVICE_NAME], self.server)
        address = f"{self.host}:{self.port}"
        try:
            bound = (self.server.add_secure_port(address, self._credentials) if self._credentials is not None
                     else self.server.add_insecure_port(address))
        except RuntimeError:   # newer grpcio raises where older ones returned 0
            bound = 0
        if bound == 0:
            raise RuntimeError(f"could not bind {self.host}:{self.port} (in use?)")
        self.port = bound
        await self.set_serving(False)
        await self.server.start()
        log.info("listening on %s:%d (%s, %s), NOT_SERVING until ready", self.host, bound, self.security,
                 ", ".join(self.service_names))
        return bound

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (*self.service_names, health.OVERALL_HEALTH):
            await self.health.set(name, status)

    def request_stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run_until_stopped(self, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or request_stop), then drain and stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stopping.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await self._stopping.wait()
        log.info("stopping: NOT_SERVING, draining in-flight calls for up to %.0f s", self.grace_s)
        await self.set_serving(False)
        await self.server.stop(self.grace_s)
        if on_stop is not None:
            await on_stop()
        log.info("stopped")
