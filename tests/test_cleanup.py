"""Nothing left behind: streams that end early (a client that disconnects, a
Cancel) release their caches on every replica they reached, whatever the
point they ended at, the first step included."""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specmesh.client import Client, build_request
from specmesh.v1 import cache_pb2, draft_pb2_grpc, verifier_pb2_grpc


def cached_sessions(cluster) -> tuple[int, int]:
    with grpc.insecure_channel(f"localhost:{cluster.draft_port}") as d, \
            grpc.insecure_channel(f"localhost:{cluster.verifier_port}") as v:
        return (draft_pb2_grpc.DraftStub(d).Info(cache_pb2.InfoRequest(), timeout=10).cached_sessions,
                verifier_pb2_grpc.VerifierStub(v).Info(cache_pb2.InfoRequest(), timeout=10).cached_sessions)


def _end_early(address: str, index: int, chunks_before_end: int) -> None:
    request = build_request(f"stream number {index} goes away", max_new_tokens=400, k=3, drafter="model",
                            session_id=f"leaver-{index}")
    with Client(address) as client:
        stream = client.stream(request)
        for seen, _ in enumerate(stream):
            if seen >= chunks_before_end:
                if index % 2:
                    try:
                        client.cancel(request.session_id)   # a Cancel from the owner...
                    except grpc.RpcError as error:          # (a fast stream may have finished meanwhile)
                        assert error.code() == grpc.StatusCode.NOT_FOUND
                else:
                    stream.cancel()                      # ... or the client simply going away
                    return
        # a cancelled stream still ends cleanly, with finish_reason "cancelled"


def test_streams_ended_at_random_points_leave_no_cache_behind(tiny_cluster):
    baseline = cached_sessions(tiny_cluster)
    rng = random.Random(7)
    ends = [rng.randint(0, 6) for _ in range(40)]   # 0: right after the first chunk, before any step returned
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda args: _end_early(tiny_cluster.address, *args), enumerate(ends)))
    deadline = time.monotonic() + 15
    while cached_sessions(tiny_cluster) != baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cached_sessions(tiny_cluster) == baseline


@pytest.mark.asyncio
async def test_a_release_queued_past_its_callers_deadline_still_happens():
    """Under load a Release waits behind long prefills on the model thread; when the
    orchestrator's deadline passes first, the cache must still go, not stay until the idle TTL."""
    import asyncio
    import threading

    from specmesh.engine_host import EngineHost
    from verifier_service.servicer import VerifierServicer

    class Engine:
        def __init__(self):
            self.sessions = {"s-1": object()}

        def release(self, session_id):
            return self.sessions.pop(session_id, None) is not None

    host, busy = EngineHost("model"), threading.Event()
    host.engine = Engine()
    prefill = asyncio.ensure_future(host.run(busy.wait, 30))   # the model thread is busy
    servicer = VerifierServicer(host)
    with pytest.raises(asyncio.TimeoutError):   # the caller gives up while the Release is queued
        await asyncio.wait_for(servicer.Release(cache_pb2.ReleaseRequest(session_id="s-1"), None), 0.2)
    busy.set()
    await prefill
    for _ in range(100):
        if not host.engine.sessions:
            break
        await asyncio.sleep(0.05)
    assert host.engine.sessions == {}
