"""What a Propose costs beyond its drafter, untraced: the service's own share of a speculative step.

    PYTHONPATH=$PWD python -m tools.rpc_cost [--calls 3000]

Starts a draft server in a second process, built as `specmesh serve draft` builds
it (ServiceRuntime with its interceptors, DraftServicer, the engine thread of
EngineHost) over an engine that answers at once with five proposals of eight
tokens each. Then calls it from this process the way the orchestrator does, with
a step's message (a 3-token sync and three feature rows). Prints the median round
trip of a Propose, of the same Propose with the engine called on the event loop
instead of its thread, and of a bare health check on the same server: what is left
once the model's time is taken out. Tracing is off, as in a bench; a traced run's
spans add their own cost (docs/distill.md, "The service overhead was overstated").
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

FEATURE_ROW_BYTES = 2 * 576      # one fp16 feature row of the default target


class _InstantEngine:
    """The draft engine's Propose surface, answering at once."""

    drafters: dict = {}
    default_drafter, max_k, sessions = "eagle-hybrid", 8, {}

    def __init__(self):
        import torch

        from specmesh.proposal import DraftProposal

        self.proposals = [DraftProposal(100 + i, torch.arange(100 + i, 108 + i), torch.full((8,), 0.125),
                                        i - 1 if i else None) for i in range(5)]

    def propose(self, *args):
        return self.proposals, 400


async def _serve(port: int, inline: bool) -> None:
    from draft_service.servicer import SERVICE_NAME, DraftServicer
    from specmesh.engine_host import EngineHost
    from specmesh.server import ServiceRuntime
    from specmesh.v1 import draft_pb2_grpc

    runtime = ServiceRuntime([SERVICE_NAME], port, host="127.0.0.1")
    host = EngineHost("draft model", tier="draft")
    host.engine = _InstantEngine()
    if inline:   # the thread hop taken out, to measure it
        async def run(fn, *args):
            return fn(*args)

        host.run = run
    servicer = DraftServicer(host)
    await runtime.start(lambda server: draft_pb2_grpc.add_DraftServicer_to_server(servicer, server))
    await runtime.set_serving(True)
    print("ready", flush=True)
    await runtime.run_until_stopped()


async def _measure(port: int, calls: int) -> dict[str, float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, sampling_pb2

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        draft, health = draft_pb2_grpc.DraftStub(channel), health_pb2_grpc.HealthStub(channel)

        def request():   # built per call, as the orchestrator builds each step's
            return draft_pb2.ProposeRequest(
                session_id="s", sync=cache_pb2.CacheSync(start=400, token_ids=[1, 2, 3], prefix_fingerprint=7),
                k=5, drafter="eagle-hybrid", sampling=sampling_pb2.SamplingParams(), seed=1, top_n=8,
                features=bytes(3 * FEATURE_ROW_BYTES))

        times: dict[str, list[float]] = {"health check": [], "propose": []}
        for i in range(calls + 200):                     # the first 200 warm up
            for name, call in (("health check", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)),
                               ("propose", lambda: draft.Propose(request(), timeout=5))):
                began = time.perf_counter()
                await call()
                if i >= 200:
                    times[name].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)      # the server process
    parser.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.inline))
        return
    from specmesh_cli.ports import free_port

    propose = {}
    for inline in (False, True):
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "tools.rpc_cost", "--serve", str(port),
                                   *(["--inline"] if inline else [])], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "OTEL_SDK_DISABLED": "true"})
        try:
            server.stdout.readline()                       # "ready"
            measured = asyncio.run(_measure(port, args.calls))
        finally:
            server.terminate()
            server.wait(timeout=30)
        if not inline:
            health = measured["health check"]              # the served server's: the one that matters
        propose[inline] = measured["propose"]
    rows = {"propose, engine on its thread (served)": propose[False],
            "propose, engine on the event loop": propose[True],
            "health check (bare gRPC, same server)": health}
    print(f"median round trip of {args.calls} calls, untraced:")
    for name, seconds in rows.items():
        print(f"  {name:<42} {seconds * 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
