"""The `specmesh` command.

    specmesh up                      all services + Redis + the HTTP gateway on this machine, one
                                     answer streamed as a check, then serve until Ctrl-C
    specmesh demo                    the same, but exit after the answer
    specmesh serve draft|verifier|orchestrator|gateway    one tier alone
    specmesh generate PROMPT         stream a completion from a running orchestrator
    specmesh bench                   speedup over target-only decoding on Spec-Bench prompts
    specmesh distill --out DIR       train a draft model for a target by self-distillation
    specmesh bench-gateway           the HTTP gateway's cost over the gRPC API, and a fuzz of it
    specmesh soak [--chaos]          many seeded streams (killing processes with --chaos): errors by status,
                                     resumes, latency, memory, and every output against its undisturbed twin
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading

from dataclasses import dataclass

from specmesh import logs, settings
from specmesh_cli import client_args
from specmesh.settings import setting

log = logging.getLogger("specmesh.cli")

DEMO_PROMPT = ("Summarize in two sentences: sunlight reaching the atmosphere is scattered by the molecules of the "
               "air, and blue light is scattered much more than red light because its wavelength is shorter, so "
               "the sky looks blue; at sunset the light crosses more air and the blue is scattered away.")


@dataclass(frozen=True)
class UpConfig:
    """`specmesh up` / `specmesh demo`: the whole stack on this machine."""

    port: int = setting(50051, "orchestrator port")
    redis_url: str | None = setting(None, "use this Redis instead of starting a redis-server", env="REDIS_URL")
    model: str | None = setting(None, "target model: 'smollm2' (default, embedded), an HF folder or hub id, "
                                      "or a .gguf file")
    draft_model: str | None = setting(None, "draft model sharing the target's vocabulary, or a shipped draft's "
                                            "name (smollm2-draft); default: the shipped draft of the default "
                                            "target, else none; 'none': n-gram only")
    eagle_model: str | None = setting(None, "EAGLE draft folder or shipped name served as the `eagle` drafter "
                                            "(smollm2-eagle); default: the default target's shipped one when "
                                            "present, else none; 'none': not served")
    draft_replicas: int = setting(1, "draft service processes")
    verifier_replicas: int = setting(1, "verifier service processes")
    draft_torch_threads: int = setting(0, "torch threads of each draft replica; 0: 1 (a draft pass is small, "
                                          "latency-bound work)")
    verifier_torch_threads: int = setting(0, "torch threads of each verifier replica; 0: this machine's cores "
                                             "split between the verifier replicas (within a stream the tiers "
                                             "take turns, so the verifier steps on every core)")
    metrics: bool = setting(False, "serve Prometheus /metrics on a free port per process")
    prompt: str = setting(DEMO_PROMPT, "the first request, streamed once everything serves")
    max_new_tokens: int = setting(96, "for the first request")
    demo: bool = setting(True, "stream the first request (--no-demo skips it)")
    http_port: int = setting(8000, "the OpenAI-compatible HTTP gateway's port; 0: no gateway")
    orchestrator_replicas: int = setting(1, "orchestrator processes sharing Redis (any can resume another's "
                                            "sessions); each gets its own port, all printed")
    host: str = setting("127.0.0.1", "interface every service listens on; 0.0.0.0 to serve other machines")


TIER_HELP = {"draft": "the draft service [port 50061]", "verifier": "the verifier service [port 50062]",
             "orchestrator": "the public gRPC API [port 50051]",
             "gateway": "the OpenAI-compatible HTTP API [port 8000]"}


def _parser() -> argparse.ArgumentParser:
    from specmesh.config import SERVICE_CONFIGS

    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    for name, what in (("up", "run Redis, draft, verifier, orchestrator and gateway as separate processes"),
                       ("demo", "like up, but exit after the first answer")):
        settings.add_flags(sub.add_parser(name, help=what), UpConfig, env_prefix=None)

    serve = sub.add_parser("serve", help="run one tier")
    tiers = serve.add_subparsers(dest="tier", required=True)
    for tier, cls in SERVICE_CONFIGS.items():
        settings.add_flags(tiers.add_parser(tier, help=TIER_HELP[tier]), cls)

    g = sub.add_parser("generate", help="stream a completion from a running orchestrator")
    g.add_argument("prompt")
    g.add_argument("--addr", default="localhost:50051")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--k", type=int, default=None, help="draft tokens per step; 0 = target-only decoding")
    g.add_argument("--drafter", default="", help="ngram, model, ... (default: the server's)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    client_args.add_client_arguments(g)

    dist = sub.add_parser("distill", help="train a draft model for a target by self-distillation")
    from distill import run as distill_run

    distill_run.add_arguments(dist)

    b = sub.add_parser("bench", help="speedup over target-only decoding on Spec-Bench prompts")
    from specmesh_cli import bench

    bench.add_arguments(b)
    from specmesh_cli import bench_gateway

    bench_gateway.add_arguments(sub.add_parser("bench-gateway", help="the HTTP gateway vs the gRPC API, and a fuzz"))
    from specmesh_cli import soak

    soak.add_arguments(sub.add_parser("soak", help="many seeded streams, optionally killing processes; a report"))
    return parser


def _serve(args) -> None:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "tier")}
    if args.tier == "gateway":   # no torch in this process
        from gateway.server import serve as serve_gateway
        from specmesh import telemetry
        from specmesh.config import GatewayConfig

        telemetry.setup("gateway")   # tracing when OTEL_* asks for it; metrics are on the HTTP port
        serve_gateway(settings.build(GatewayConfig, flags))
        return
    import torch

    from specmesh import telemetry
    from specmesh.config import SERVICE_CONFIGS

    config = settings.build(SERVICE_CONFIGS[args.tier], flags)
    if args.tier == "draft":
        from draft_service.server import serve
    elif args.tier == "verifier":
        from verifier_service.server import serve
    else:
        from orchestrator.server import serve
    if getattr(config, "torch_threads", 0):
        torch.set_num_threads(config.torch_threads)
    # Said once, because the launcher and the environment both set it and it moves a step's time most.
    log.info("torch intra-op threads: %d", torch.get_num_threads())
    # Tracing only when OTEL_* ask for it; metrics only with a port.
    telemetry.setup(args.tier, config.metrics_port, metrics_addr="0.0.0.0" if config.host == "[::]" else config.host)
    asyncio.run(serve(config))


def _generate(args) -> int:
    import grpc

    from specmesh.client import Completion, build_request

    request = build_request(args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            k=args.k, drafter=args.drafter, stop=args.stop)
    completion = Completion()
    try:
        with client_args.client_for(args) as client:
            for chunk in client.stream(request):
                completion.add(chunk)
                if not args.json and chunk.text:
                    print(chunk.text, end="", flush=True)
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as error:   # a token or certificate file that is missing or wrong
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(completion.as_dict()))
    else:
        print()
        print(summary(completion), file=sys.stderr)
    return 0


def summary(c) -> str:
    s = c.stats
    return (f"[{s.committed_tokens} tokens, {s.tokens_per_second:.1f} tokens/s, finish: {c.finish_reason}, "
            f"drafter: {c.drafter}, k: {c.k}, steps: {s.steps}, acceptance rate: {s.acceptance_rate:.2f}, "
            f"committed tokens per step: {s.committed_per_step:.2f}, ttft: {s.time_to_first_token_s:.2f} s]")


def _up(args, exit_after_demo: bool = False) -> int:
    import grpc

    from specmesh_cli.launcher import Cluster

    up = settings.build(UpConfig, {k: v for k, v in vars(args).items() if k != "command"}, env_prefix=None)
    from specmesh.drafts import draft_for, eagle_for

    try:
        cluster = Cluster(model=up.model, draft_model=draft_for(up.model, up.draft_model),
                          eagle_model=eagle_for(up.model, up.eagle_model), port=up.port,
                          redis_url=up.redis_url,
                          draft_replicas=up.draft_replicas, verifier_replicas=up.verifier_replicas,
                          draft_torch_threads=up.draft_torch_threads or None,
                          verifier_torch_threads=up.verifier_torch_threads or None,
                          metrics=up.metrics, http_port=up.http_port or None, host=up.host,
                          orchestrator_replicas=up.orchestrator_replicas)
    except ValueError as error:   # a setting out of range (a thread count below 0): say it, no traceback
        log.error("%s", error)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("starting %d verifier and %d draft replica(s) (the first start converts the default model, ~25 s)",
             up.verifier_replicas, up.draft_replicas)
    try:
        cluster.start()
    except Exception as error:  # noqa: BLE001 - tell the person, not a traceback
        log.error("start-up failed: %s", error)
        return 1
    try:
        print(f"specmesh orchestrator SERVING at {cluster.address}", flush=True)
        if len(cluster.orchestrator_ports) > 1:
            print(f"  all {len(cluster.orchestrator_ports)} orchestrators (a client resumes on any): "
                  f"{cluster.target}", flush=True)
        if cluster.http_port:
            print(f"OpenAI-compatible API at {cluster.http_url}/v1 (model: {cluster.served_model()})", flush=True)
        for name in sorted(cluster.metrics_ports):
            print(f"  {name} metrics: {cluster.metrics_url(name)}", flush=True)
        if up.demo or exit_after_demo:
            try:
                _demo(cluster.address, up.prompt, up.max_new_tokens)
            except grpc.RpcError as error:   # say what failed, keep serving (demo: exit 1)
                log.error("the first request failed: %s: %s", error.code().name, error.details())
                if exit_after_demo:
                    return 1
        if exit_after_demo:
            return 0
        print(f"try: specmesh generate --addr {cluster.address} --chat \"Write a haiku about caches\"", flush=True)
        if cluster.http_port:
            print(f"  or: curl -N {cluster.http_url}/v1/chat/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{cluster.served_model()}\", \"stream\": true, "
                  f"\"messages\": [{{\"role\": \"user\", \"content\": \"Write a haiku about caches\"}}]}}'",
                  flush=True)
        print("Ctrl-C (or SIGTERM) stops every service.", flush=True)
        while not stop.wait(1.0):
            cluster.supervise()   # a child that died is restarted, as Kubernetes would
        return 0
    finally:
        codes = cluster.stop()
        log.info("all services stopped (exit codes: %s)", codes)


def _demo(address: str, prompt: str, max_new_tokens: int) -> None:
    """Stream one chat answer through the whole stack, then its stats."""
    from specmesh.client import Client, Completion, build_request

    print(f"\n> {prompt}\n", flush=True)
    completion = Completion()
    with Client(address) as client:
        for chunk in client.stream(build_request(prompt, chat=True, max_new_tokens=max_new_tokens)):
            completion.add(chunk)
            print(chunk.text, end="", flush=True)
    print("\n\n" + summary(completion) + "\n", flush=True)


def _soak(args) -> int:
    from specmesh_cli import soak

    return soak.run(args)


def main(argv: list[str] | None = None) -> int:
    from specmesh_cli import children

    children.arm_from_env()   # a service the launcher started dies with it
    args = _parser().parse_args(argv)
    logs.setup(args.command if args.command != "serve" else args.tier)
    if args.command == "serve":
        try:
            _serve(args)
        except ValueError as error:   # a setting from the environment that does not parse
            print(f"specmesh serve {args.tier}: {error}", file=sys.stderr)
            return 2
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "up":
        return _up(args)
    if args.command == "demo":
        return _up(args, exit_after_demo=True)
    if args.command == "distill":
        from distill import run as distill_run

        return distill_run.main(args, list(argv if argv is not None else sys.argv[1:])[1:])
    if args.command == "bench":
        from specmesh_cli import bench

        return bench.run(args)
    if args.command == "bench-gateway":
        from specmesh_cli import bench_gateway

        return bench_gateway.run(args)
    if args.command == "soak":
        return _soak(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
