"""The `specmesh` command.

    specmesh up                      all three services + Redis on this machine, one
                                     answer streamed as a check, then serve until Ctrl-C
    specmesh demo                    the same, but exit after the answer
    specmesh serve draft|verifier|orchestrator    one tier alone
    specmesh generate PROMPT         stream a completion from a running orchestrator
    specmesh bench                   speedup over target-only decoding on Spec-Bench prompts
    specmesh distill --out DIR       train a draft model for a target by self-distillation
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

from specmesh import logs

log = logging.getLogger("specmesh.cli")

DEMO_PROMPT = ("Summarize in two sentences: sunlight reaching the atmosphere is scattered by the molecules of the "
               "air, and blue light is scattered much more than red light because its wavelength is shorter, so "
               "the sky looks blue; at sunset the light crosses more air and the blue is scattered away.")


def _add_model_flags(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument("--model", default=None, help="target model: 'smollm2' (default, embedded), an HF folder or hub id, "
                                                "or a .gguf file [SPECMESH_MODEL]")
    if draft:
        p.add_argument("--draft-model", default=None, help="draft model sharing the target's vocabulary, or a shipped "
                            "draft's name (smollm2-draft); default: the shipped draft of the default target, else "
                            "none; 'none': n-gram only [SPECMESH_DRAFT_MODEL]")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Redis, draft, verifier and orchestrator as separate processes")
    demo = sub.add_parser("demo", help="like up, but exit after the first answer")
    for p in (up, demo):
        p.add_argument("--port", type=int, default=50051, help="orchestrator port (default 50051)")
        p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                       help="use this Redis instead of starting one [REDIS_URL]")
        p.add_argument("--draft-replicas", type=int, default=1)
        p.add_argument("--verifier-replicas", type=int, default=1)
        p.add_argument("--prompt", default=DEMO_PROMPT, help="the first request, sent once everything serves")
        p.add_argument("--max-new-tokens", type=int, default=96, help="for the first request")
        p.add_argument("--metrics", action="store_true", help="serve Prometheus /metrics on a free port per process")
        _add_model_flags(p)
    up.add_argument("--no-demo", action="store_true", help="skip the first request")

    serve = sub.add_parser("serve", help="run one tier")
    tiers = serve.add_subparsers(dest="tier", required=True)
    d = tiers.add_parser("draft", help="the draft service [port 50061]")
    d.add_argument("--port", type=int)
    d.add_argument("--draft-model", default=None, help="[SPECMESH_DRAFT_MODEL]")
    d.add_argument("--device", default=None, help="cpu or cuda [SPECMESH_DEVICE]")
    d.add_argument("--max-k", type=int, help="[SPECMESH_MAX_K]")
    d.add_argument("--default-drafter", default=None, help="[SPECMESH_DEFAULT_DRAFTER]")
    d.add_argument("--max-sessions", type=int, help="cached sessions before LRU eviction [SPECMESH_MAX_SESSIONS]")
    d.add_argument("--torch-threads", type=int, help="torch threads (default 1) [SPECMESH_TORCH_THREADS]")
    d.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here [SPECMESH_METRICS_PORT]")
    v = tiers.add_parser("verifier", help="the verifier service [port 50062]")
    v.add_argument("--port", type=int)
    v.add_argument("--model", default=None, help="[SPECMESH_MODEL]")
    v.add_argument("--device", default=None, help="cpu or cuda [SPECMESH_DEVICE]")
    v.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 [SPECMESH_DTYPE]")
    v.add_argument("--max-sessions", type=int, help="cached sessions before LRU eviction [SPECMESH_MAX_SESSIONS]")
    v.add_argument("--max-batch", type=int, help="Verify calls sharing one forward pass, 1 disables [SPECMESH_MAX_BATCH]")
    v.add_argument("--torch-threads", type=int, help="torch threads (default: every core) [SPECMESH_TORCH_THREADS]")
    v.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here [SPECMESH_METRICS_PORT]")
    o = tiers.add_parser("orchestrator", help="the public API [port 50051]")
    o.add_argument("--port", type=int)
    o.add_argument("--model", default=None, help="the target's tokenizer [SPECMESH_MODEL]")
    o.add_argument("--draft-addrs", default=None, help="comma-separated draft replicas [SPECMESH_DRAFT_ADDRS]")
    o.add_argument("--verifier-addrs", default=None, help="comma-separated verifier replicas [SPECMESH_VERIFIER_ADDRS]")
    o.add_argument("--redis-url", default=None, help="[REDIS_URL]")
    o.add_argument("--session-ttl-s", type=int, help="[SPECMESH_SESSION_TTL_S]")
    o.add_argument("--default-k", type=int, help="[SPECMESH_DEFAULT_K]")
    o.add_argument("--max-k", type=int, help="[SPECMESH_MAX_K]")
    o.add_argument("--default-drafter", default=None, help="[SPECMESH_DEFAULT_DRAFTER]")
    o.add_argument("--draft-top-n", type=int, help="truncate each proposal q to this many tokens [SPECMESH_DRAFT_TOP_N]")
    o.add_argument("--max-active-sessions", type=int, help="[SPECMESH_MAX_ACTIVE_SESSIONS]")
    o.add_argument("--replica-retry-s", type=float,
                   help="retry this long when every replica of a tier fails [SPECMESH_REPLICA_RETRY_S]")
    o.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here [SPECMESH_METRICS_PORT]")

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

    b = sub.add_parser("bench", help="speedup over target-only decoding on Spec-Bench prompts")
    from specmesh import bench

    bench.add_arguments(b)

    dist = sub.add_parser("distill", help="train a draft model for a target by self-distillation")
    from distill import run as distill_run

    distill_run.add_arguments(dist)
    return parser


def _serve(args) -> None:
    from specmesh import config as cfg

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "tier")}
    import torch

    if args.tier == "draft":
        from draft_service.server import serve

        config = cfg.from_env(cfg.DraftConfig, overrides)
        torch.set_num_threads(config.torch_threads)
    elif args.tier == "verifier":
        from verifier_service.server import serve

        config = cfg.from_env(cfg.VerifierConfig, overrides)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
    else:
        from orchestrator.server import serve

        config = cfg.from_env(cfg.OrchestratorConfig, overrides)
    from specmesh import telemetry

    # Tracing only when OTEL_* / SPECMESH_TRACE_FILE ask for it; metrics only with a port.
    telemetry.setup(args.tier, config.metrics_port)
    asyncio.run(serve(config))


def _generate(args) -> int:
    import grpc

    from specmesh.client import Client, Completion, build_request

    request = build_request(args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            k=args.k, drafter=args.drafter, stop=args.stop)
    completion = Completion()
    try:
        with Client(args.addr) as client:
            for chunk in client.stream(request):
                completion.add(chunk)
                if not args.json and chunk.text:
                    print(chunk.text, end="", flush=True)
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(completion.as_dict()))
    else:
        print()
        print(summary(completion), file=sys.stderr)
    return 0


def summary(c) -> str:
    s = c.stats
    return (f"[{s.generated_tokens} tokens, {s.tokens_per_second:.1f} tokens/s, finish: {c.finish_reason}, "
            f"drafter: {c.drafter}, k: {c.k}, steps: {s.steps}, acceptance rate: {s.acceptance_rate:.2f}, "
            f"mean accepted tokens per step: {s.mean_accepted_per_step:.2f}, ttft: {s.time_to_first_token_s:.2f} s]")


def _up(args, exit_after_demo: bool = False) -> int:
    from specmesh.drafts import draft_for
    from specmesh.launcher import Cluster

    cluster = Cluster(model=args.model, draft_model=draft_for(args.model, args.draft_model), port=args.port,
                      redis_url=args.redis_url,
                      draft_replicas=args.draft_replicas, verifier_replicas=args.verifier_replicas,
                      metrics=args.metrics)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("starting %d verifier and %d draft replica(s) (the first start converts the default model, ~25 s)",
             args.verifier_replicas, args.draft_replicas)
    try:
        cluster.start()
    except Exception as error:  # noqa: BLE001 - tell the person, not a traceback
        log.error("start-up failed: %s", error)
        return 1
    try:
        print(f"specmesh orchestrator SERVING at {cluster.address}", flush=True)
        for name in sorted(cluster.metrics_ports):
            print(f"  {name} metrics: {cluster.metrics_url(name)}", flush=True)
        if not getattr(args, "no_demo", False):
            _demo(cluster.address, args.prompt, args.max_new_tokens)
        if exit_after_demo:
            return 0
        print(f"try: specmesh generate --addr {cluster.address} --chat \"Write a haiku about caches\"\n"
              "Ctrl-C (or SIGTERM) stops every service.", flush=True)
        while not stop.wait(1.0):
            dead = [t for t, p in cluster.processes.items() if p.poll() is not None]
            if dead:
                log.error("%s exited; shutting down", ", ".join(dead))
                return 1
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "distill":
        from distill import run as distill_run

        logs.setup("distill")
        return distill_run.main(args, list(argv if argv is not None else sys.argv[1:])[1:])
    logs.setup(args.command if args.command != "serve" else args.tier)
    if args.command == "serve":
        _serve(args)
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "up":
        return _up(args)
    if args.command == "demo":
        return _up(args, exit_after_demo=True)
    if args.command == "bench":
        from specmesh import bench

        return bench.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
