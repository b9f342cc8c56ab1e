"""The gateway's one gRPC channel to the orchestrator's public API."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import from_grpc
from gateway.translate import Served
from specmesh import telemetry
from specmesh.bounds import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from specmesh.tls import ChannelTLS, aio_channel
from specmesh.v1 import orchestrator_pb2, orchestrator_pb2_grpc

ORCHESTRATOR_SERVICE = "specmesh.v1.Orchestrator"


class Upstream:
    """Generate calls, ListModels (cached: the model list changes only when replicas are redeployed) and health."""

    def __init__(self, address: str, timeout_s: float, served_name: str = "", models_ttl_s: float = 10.0,
                 tls: ChannelTLS | None = None):
        # One channel: HTTP/2 multiplexes every stream of this gateway over it.
        self.channel = aio_channel(address, tls, interceptors=telemetry.client_interceptors() or None,
                                   options=message_size_options(DEFAULT_MAX_MESSAGE_BYTES))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.timeout_s = timeout_s
        self.served_name = served_name
        self.models_ttl_s = models_ttl_s
        self._served: Served | None = None
        self._fetched_at = 0.0

    async def served(self) -> Served:
        """What the orchestrator serves; a stale answer beats an error while it is briefly unreachable."""
        if self._served is not None and time.monotonic() - self._fetched_at < self.models_ttl_s:
            return self._served
        try:
            reply = await self.stub.ListModels(orchestrator_pb2.ListModelsRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            if self._served is not None:
                return self._served
            raise from_grpc(error) from None
        self._served, self._fetched_at = Served.from_pb(reply, self.served_name), time.monotonic()
        return self._served

    def generate(self, request: orchestrator_pb2.GenerateRequest, authorization: str | None = None
                 ) -> grpc.aio.UnaryStreamCall:
        """The client's own `Authorization: Bearer` goes through: the orchestrator decides who may call."""
        metadata = (("authorization", authorization),) if authorization else None
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=metadata)

    async def healthy(self) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=ORCHESTRATOR_SERVICE), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()
