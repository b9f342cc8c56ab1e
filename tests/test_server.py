"""The one status interceptor, on a real gRPC server over a socket: requests that do not
decode get INVALID_ARGUMENT on every kind of method, oversized ones RESOURCE_EXHAUSTED,
and a status never carries more than a short message."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.errors import InvalidArgument
from specmesh.server import MAX_DETAILS_CHARS, ServiceRuntime
from specmesh.v1 import cache_pb2, draft_pb2_grpc

BAD_UTF8 = b"\x0a\x02\xff\xfe"     # ReleaseRequest.session_id (field 1) holding two bytes that are not UTF-8
CORRUPT = b"\xff\xff\xff"


class Servicer(draft_pb2_grpc.DraftServicer):
    async def Release(self, request, context):
        if request.session_id == "long":
            raise InvalidArgument("session_id", "x" * 100_000)
        if request.session_id == "bug":
            raise KeyError("a bug")
        return cache_pb2.ReleaseResponse(released=request.session_id == "known")


def register(server: grpc.aio.Server) -> None:
    draft_pb2_grpc.add_DraftServicer_to_server(Servicer(), server)


@pytest.fixture
async def server():
    runtime = ServiceRuntime(["specmesh.v1.Draft"], 0, host="127.0.0.1", max_message_bytes=64 * 1024)
    port = await runtime.start(register)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await runtime.server.stop(None)


async def _code(call, payload) -> tuple[grpc.StatusCode, str]:
    try:
        await call(payload, timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("payload", [BAD_UTF8, CORRUPT], ids=["invalid utf-8", "corrupt"])
async def test_undecodable_requests_are_invalid_argument(server, payload):
    code, details = await _code(server.unary_unary("/specmesh.v1.Draft/Release"), payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("request: not a valid Release message"), details
    # Library services on the same port too: health (unary and streaming) and reflection (bidirectional).
    for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"):
        try:
            if method.endswith("Check"):
                await server.unary_unary(method)(payload, timeout=10)
            else:
                [reply async for reply in server.unary_stream(method)(payload, timeout=10)]
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            code = error.code()
        assert code == grpc.StatusCode.INVALID_ARGUMENT, method
    reflection = server.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in reflection(iter([b"\x3a\x00", payload]), timeout=10)]   # a good request, then a bad one
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_decodable_requests_reach_the_handler(server):
    reply = await server.unary_unary("/specmesh.v1.Draft/Release")(
        cache_pb2.ReleaseRequest(session_id="known").SerializeToString(), timeout=10)
    assert cache_pb2.ReleaseResponse.FromString(reply).released
    health = health_pb2_grpc.HealthStub(server)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING   # not yet set serving: answered, not refused


async def test_a_message_over_the_limit_is_resource_exhausted(server):
    code, _ = await _code(server.unary_unary("/specmesh.v1.Draft/Release"),
                          cache_pb2.ReleaseRequest(session_id="x" * 70_000).SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_status_details_stay_short_and_bugs_stay_internal(server):
    call = server.unary_unary("/specmesh.v1.Draft/Release")
    code, details = await _code(call, cache_pb2.ReleaseRequest(session_id="long").SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) <= MAX_DETAILS_CHARS + 3
    code, details = await _code(call, cache_pb2.ReleaseRequest(session_id="bug").SerializeToString())
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in details


async def test_a_port_in_use_stops_start_up_instead_of_being_shared():
    """gRPC's servers set SO_REUSEPORT; ours turn it off. With it on, a second server on a bound port starts
    and takes part of the first one's connections (a launcher's health check could reach the wrong
    service and wait forever)."""
    first = ServiceRuntime(["specmesh.v1.Draft"], 0, host="127.0.0.1")
    port = await first.start(register)
    try:
        second = ServiceRuntime(["specmesh.v1.Draft"], port, host="127.0.0.1")
        with pytest.raises(RuntimeError, match=f"could not bind 127.0.0.1:{port}"):
            await second.start(register)
    finally:
        await first.server.stop(None)


async def test_waiting_for_a_replica_leaves_no_stream_open_on_it():
    """The orchestrator waits for each replica with a health Watch. Once SERVING it must end that stream:
    a replica stopping gracefully (a rolling update, `specmesh up` restarting one) waits for its open
    calls, and an abandoned Watch held every such stop for its whole grace period."""
    from types import SimpleNamespace

    from orchestrator.server import when_serving

    runtime = ServiceRuntime(["specmesh.v1.Draft"], 0, host="127.0.0.1", grace_s=60)
    port = await runtime.start(register)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        replica = SimpleNamespace(channel=channel, address=f"127.0.0.1:{port}")
        waiting = asyncio.create_task(when_serving(replica, "specmesh.v1.Draft"))
        await asyncio.sleep(0.5)
        assert not waiting.done()   # NOT_SERVING until set_serving
        await runtime.set_serving(True)
        await asyncio.wait_for(waiting, 10)
        # With no call open, a graceful stop ends at once, not after the 60 s grace (given 20 here).
        await asyncio.wait_for(runtime.server.stop(60), 20)
