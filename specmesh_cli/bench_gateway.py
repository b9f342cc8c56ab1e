"""`specmesh bench-gateway`: what the HTTP gateway costs over the gRPC API.

The same prompts go through both paths in one run, interleaved (gRPC then
HTTP for one prompt, HTTP then gRPC for the next) so both see the same
machine load: greedy chat completions, streamed. Per path it measures
committed tokens / wall time and the client's time to first token; the HTTP
path reads the SSE stream with a lean client (httpx), as the gRPC path uses
the plain stub, so the figure is the gateway's cost, not a client library's.
Greedy text must be identical on both paths; mismatches are counted.

With a model on a shared CPU the time to first token varies by hundreds of
ms, so the gateway's own added latency is also measured against an instant
stub orchestrator (a gRPC server in this process that answers at once).

Then it sends `--fuzz` malformed requests (gateway.fuzz's hypothesis
strategies) and counts 5xx answers, and checks every service is still healthy.

Prints the figures against the issue's goals and writes bench_gateway.json.
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

log = logging.getLogger("specmesh.bench")

GOALS = {"throughput_ratio": 0.95, "added_ttft_p50_ms": 5.0, "fuzz_5xx": 0}


def add_arguments(p) -> None:
    from specmesh import spec_bench

    p.add_argument("--addr", default=None, help="a running orchestrator (with --http-url); default: start a stack")
    p.add_argument("--http-url", default=None, help="its gateway, e.g. http://localhost:8000")
    p.add_argument("--model", default=None, help="target model when starting services [SPECMESH_MODEL]")
    p.add_argument("--draft-model", default=None, help="draft model when starting services")
    p.add_argument("--eagle-model", default=None,
                   help="EAGLE draft (the `eagle` drafter) when starting services; default: the target's shipped one")
    p.add_argument("--questions", type=Path, default=spec_bench.QUESTIONS, help="Spec-Bench question.jsonl")
    p.add_argument("--per-category", type=int, default=1, help="questions taken from each category")
    p.add_argument("--repeats", type=int, default=2, help="each prompt this many times per path")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the server's)")
    p.add_argument("--drafter", default="", help="(default: the server's)")
    p.add_argument("--ttft-pairs", type=int, default=40,
                   help="short requests (4 tokens) per path for the added time to first token")
    p.add_argument("--instant-pairs", type=int, default=400,
                   help="requests per path against an instant stub orchestrator: the gateway's own added TTFT")
    p.add_argument("--fuzz", type=int, default=1000, help="malformed requests to send (0: none)")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for bench_gateway.json")


def _grpc_once(client, prompt: str, args) -> dict:
    from specmesh.client import build_request

    request = build_request(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=0.0, k=args.k,
                            drafter=args.drafter)
    started = time.perf_counter()
    ttft, text, tokens = None, "", 0
    for chunk in client.stream(request):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - started
        text += chunk.text
        tokens += len(chunk.token_ids)
    return {"ttft_s": ttft, "elapsed_s": time.perf_counter() - started, "tokens": tokens, "text": text}


def _http_once(http, model: str, prompt: str, args) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_new_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if args.k is not None:
        body["k"] = args.k
    if args.drafter:
        body["drafter"] = args.drafter
    started = time.perf_counter()
    ttft, text, tokens = None, "", 0
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"gateway answered {reply.status_code}: {reply.read().decode(errors='replace')}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                content = chunk["choices"][0]["delta"].get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text += content
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": ttft, "elapsed_s": time.perf_counter() - started, "tokens": tokens, "text": text}


def measure_ttft(address: str, http_url: str, model: str, pairs: int, args) -> dict:
    """Short greedy requests, interleaved: the time to first token is mostly the path, not prefill."""
    import argparse

    import httpx

    from specmesh.client import Client

    short = argparse.Namespace(**{**vars(args), "max_new_tokens": 4})
    diffs, grpc_t, http_t = [], [], []
    with Client(address) as client, httpx.Client(base_url=http_url, timeout=600) as http:
        for n in range(pairs):
            prompt = f"Say the number {n}."
            order = ("grpc", "http") if n % 2 == 0 else ("http", "grpc")
            got = {}
            for path in order:
                got[path] = (_grpc_once(client, prompt, short) if path == "grpc"
                             else _http_once(http, model, prompt, short))["ttft_s"]
            if got["grpc"] is not None and got["http"] is not None:
                grpc_t.append(got["grpc"])
                http_t.append(got["http"])
                diffs.append(got["http"] - got["grpc"])
    print(f"ttft: {len(diffs)} short pairs", file=sys.stderr, flush=True)
    return {"ttft_pairs": len(diffs), "short_grpc_ttft_p50_ms": 1000 * statistics.median(grpc_t),
            "short_http_ttft_p50_ms": 1000 * statistics.median(http_t),
            "added_ttft_p50_ms": 1000 * statistics.median(diffs)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): what it costs, whatever the machine's load."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_gateway_latency(pairs: int) -> dict:
    """The gateway's own added time to first token, without a model's noise: a gateway process in front of
    an in-process stub orchestrator that answers at once, against the stub called directly over gRPC."""
    import asyncio
    import os
    import subprocess
    import threading

    import grpc
    import httpx

    from specmesh_cli.launcher import wait_http_ok
    from specmesh.server import NO_PORT_SHARING
    from specmesh_cli.ports import free_port
    from specmesh.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    class Instant(orchestrator_pb2_grpc.OrchestratorServicer):
        async def Generate(self, request, context):
            yield orchestrator_pb2.GenerateChunk(session_id="s", seed=1, drafter="ngram", k=4)
            yield orchestrator_pb2.GenerateChunk(text="tok", token_ids=[1])
            yield orchestrator_pb2.GenerateChunk(finish_reason="length")

        async def ListModels(self, request, context):
            return orchestrator_pb2.ListModelsResponse(target_model="instant")

    port, ready, loop = free_port(), threading.Event(), asyncio.new_event_loop()

    async def serve():
        server = grpc.aio.server(options=[NO_PORT_SHARING])   # a port in use fails here, not shared
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Instant(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True).start()
    ready.wait(30)
    http_port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "specmesh_cli.cli", "serve", "gateway", "--http-port", str(http_port),
                                "--orchestrator-addr", f"127.0.0.1:{port}"], env=dict(os.environ),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = {"model": "instant", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 4}

    def via_grpc(stub) -> float:
        started = time.perf_counter()
        for chunk in stub.Generate(orchestrator_pb2.GenerateRequest(text="x")):
            if chunk.token_ids:
                return time.perf_counter() - started

    def via_http(http) -> float:
        started = time.perf_counter()
        with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            for line in reply.iter_lines():
                if '"content":"tok"' in line:
                    return time.perf_counter() - started

    try:
        wait_http_ok(f"http://127.0.0.1:{http_port}/ping", gateway, 60, "gateway")   # the stub has no health service
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
                httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for _ in range(20):   # warm both
                via_grpc(stub), via_http(http)
            g, h = [], []
            for n in range(pairs):
                if n % 2:
                    g.append(via_grpc(stub)), h.append(via_http(http))
                else:
                    h.append(via_http(http)), g.append(via_grpc(stub))
    finally:
        gateway.terminate()
        gateway.wait()
    return {"instant_pairs": pairs, "instant_grpc_ttft_p50_ms": 1000 * statistics.median(g),
            "instant_http_ttft_p50_ms": 1000 * statistics.median(h),
            "instant_added_ttft_p50_ms": 1000 * statistics.median(b - a for a, b in zip(g, h))}


def measure_paths(address: str, http_url: str, prompts: list[str], args, pids: dict[str, int] | None = None) -> dict:
    import httpx

    from specmesh.client import Client

    rows = []
    with Client(address) as client, httpx.Client(base_url=http_url, timeout=600) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        _grpc_once(client, "Hello", args)          # warm both paths: lazy initialisation is not billed
        _http_once(http, model, "Hello", args)
        jobs = [(i, p) for i, p in enumerate(prompts) for _ in range(args.repeats)]
        cpu_before = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
        for n, (i, prompt) in enumerate(jobs):
            order = ("grpc", "http") if n % 2 == 0 else ("http", "grpc")
            pair = {}
            for path in order:
                pair[path] = _grpc_once(client, prompt, args) if path == "grpc" else _http_once(http, model, prompt, args)
            rows.append({"prompt": i, **{f"{path}_{k}": v for path in pair for k, v in pair[path].items() if k != "text"},
                         "same_text": pair["grpc"]["text"] == pair["http"]["text"]})
            g, h = pair["grpc"], pair["http"]
            print(f"[{n + 1}/{len(jobs)}] prompt {i}: gRPC {g['tokens']} tok {g['tokens'] / g['elapsed_s']:6.1f} tok/s "
                  f"ttft {1000 * (g['ttft_s'] or 0):6.1f} ms | HTTP {h['tokens']} tok "
                  f"{h['tokens'] / h['elapsed_s']:6.1f} tok/s ttft {1000 * (h['ttft_s'] or 0):6.1f} ms"
                  f"{'' if rows[-1]['same_text'] else '  TEXT DIFFERS'}", file=sys.stderr, flush=True)
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in (pids or {}).items()}
    grpc_tps = sum(r["grpc_tokens"] for r in rows) / sum(r["grpc_elapsed_s"] for r in rows)
    http_tps = sum(r["http_tokens"] for r in rows) / sum(r["http_elapsed_s"] for r in rows)
    paired = [r for r in rows if r["grpc_ttft_s"] is not None and r["http_ttft_s"] is not None]
    return {
        "requests_per_path": len(rows), "model": model,
        "grpc_tokens_per_s": grpc_tps, "http_tokens_per_s": http_tps, "throughput_ratio": http_tps / grpc_tps,
        "grpc_ttft_p50_ms": 1000 * statistics.median(r["grpc_ttft_s"] for r in paired),
        "http_ttft_p50_ms": 1000 * statistics.median(r["http_ttft_s"] for r in paired),
        "long_added_ttft_p50_ms": 1000 * statistics.median(r["http_ttft_s"] - r["grpc_ttft_s"] for r in paired),
        "text_mismatches": sum(1 for r in rows if not r["same_text"]),
        # CPU per committed token: the gateway's counts only HTTP-path tokens, the orchestrator's both paths'.
        "cpu_ms_per_token": {name: 1000 * seconds / max(1, sum(r["http_tokens"] for r in rows) if name == "gateway"
                                                         else sum(r["http_tokens"] + r["grpc_tokens"] for r in rows))
                             for name, seconds in cpu.items()},
        "rows": rows,
    }


def fuzz(http_url: str, model: str, count: int) -> dict:
    """`count` malformed requests; statuses counted, nothing asserted (the test asserts)."""
    import httpx
    from hypothesis import HealthCheck, given, settings

    from gateway.fuzz import malformed_requests

    statuses: Counter = Counter()
    examples: list = []
    with httpx.Client(base_url=http_url, timeout=120) as http:
        @settings(max_examples=count, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(malformed_requests(model))
        def send(request):
            method, path, body, content_type = request
            try:
                reply = http.request(method, path, content=body,
                                     headers={"content-type": content_type} if content_type else {})
                status = reply.status_code
            except httpx.HTTPError as error:   # a dropped connection counts as a failure too
                status, reply = 599, error
            statuses[status] += 1
            if status >= 500 and len(examples) < 5:
                examples.append({"request": [method, path, body.decode(errors="replace")[:300]],
                                 "reply": str(getattr(reply, "text", reply))[:300]})
            if sum(statuses.values()) % 100 == 0:
                print(f"fuzz: {sum(statuses.values())}/{count} sent, {dict(sorted(statuses.items()))}",
                      file=sys.stderr, flush=True)

        send()
    return {"sent": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "fuzz_5xx": sum(n for s, n in statuses.items() if s >= 500), "examples_5xx": examples}


def healthy(address: str, http_url: str, cluster) -> dict:
    import httpx

    from specmesh_cli.launcher import wait_serving

    out = {"gateway": httpx.get(f"{http_url}/health", timeout=10).status_code == 200}
    targets = {"orchestrator": (address, "specmesh.v1.Orchestrator")}
    if cluster is not None:
        targets.update({"draft": (f"localhost:{cluster.draft_port}", "specmesh.v1.Draft"),
                        "verifier": (f"localhost:{cluster.verifier_port}", "specmesh.v1.Verifier")})
    for name, (addr, service) in targets.items():
        try:
            wait_serving(addr, service, None, 5)
            out[name] = True
        except TimeoutError:
            out[name] = False
    return out


def run(args) -> int:
    from specmesh_cli.bench import load_questions
    from specmesh_cli.launcher import Cluster

    prompts = [q["turns"][0] for q in load_questions(args.questions, [], args.per_category, [])]
    cluster, address, http_url = None, args.addr, args.http_url
    if address is None or http_url is None:
        from specmesh_cli.ports import free_port

        from specmesh.drafts import eagle_for

        cluster = Cluster(model=args.model, draft_model=args.draft_model, eagle_model=eagle_for(args.model, args.eagle_model),
                          port=free_port(), http_port=free_port(),
                          log_dir=args.out / "logs")
        log.info("starting services and the gateway (logs in %s)", args.out / "logs")
        cluster.start()
        address, http_url = cluster.address, cluster.http_url
    try:
        pids = {name: cluster.processes[name].pid for name in ("gateway", "orchestrator")} if cluster else None
        result = measure_paths(address, http_url, prompts, args, pids)
        if args.ttft_pairs:
            result.update(measure_ttft(address, http_url, result["model"], args.ttft_pairs, args))
        if args.fuzz:
            result.update(fuzz(http_url, result["model"], args.fuzz))
        result["healthy_after"] = healthy(address, http_url, cluster)
    finally:
        if cluster is not None:
            cluster.stop()
    if args.instant_pairs:
        result.update(measure_gateway_latency(args.instant_pairs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gateway.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


def report(r: dict) -> str:
    def verdict(ok: bool) -> str:
        return "meets goal" if ok else "MISSES goal"

    lines = [
        f"gateway vs gRPC API, {r['requests_per_path']} streamed greedy chat completions per path, model {r['model']}",
        f"  throughput   gRPC {r['grpc_tokens_per_s']:.1f} tok/s   HTTP {r['http_tokens_per_s']:.1f} tok/s   "
        f"ratio {r['throughput_ratio']:.3f}x   ({verdict(r['throughput_ratio'] >= GOALS['throughput_ratio'])} "
        f">= {GOALS['throughput_ratio']}x)",
        f"  TTFT p50, those requests   gRPC {r['grpc_ttft_p50_ms']:.1f} ms   HTTP {r['http_ttft_p50_ms']:.1f} ms   "
        f"paired difference p50 {r['long_added_ttft_p50_ms']:.2f} ms",
        *(["  CPU per committed token: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in r["cpu_ms_per_token"].items())
           + " (gateway: HTTP-path tokens; orchestrator: both paths)"] if r.get("cpu_ms_per_token") else []),
        f"  greedy text identical on both paths: {r['requests_per_path'] - r['text_mismatches']}"
        f"/{r['requests_per_path']}",
    ]
    if "ttft_pairs" in r:
        lines.append(f"  added TTFT   {r['ttft_pairs']} short request pairs: gRPC p50 {r['short_grpc_ttft_p50_ms']:.1f} ms, "
                     f"HTTP p50 {r['short_http_ttft_p50_ms']:.1f} ms, paired difference p50 "
                     f"{r['added_ttft_p50_ms']:.2f} ms ({verdict(r['added_ttft_p50_ms'] <= GOALS['added_ttft_p50_ms'])} "
                     f"<= {GOALS['added_ttft_p50_ms']} ms)")
    if "instant_pairs" in r:
        lines.append(f"  added TTFT, the gateway alone ({r['instant_pairs']} pairs against an instant stub orchestrator): "
                     f"gRPC p50 {r['instant_grpc_ttft_p50_ms']:.2f} ms, HTTP p50 {r['instant_http_ttft_p50_ms']:.2f} ms, "
                     f"added p50 {r['instant_added_ttft_p50_ms']:.2f} ms "
                     f"({verdict(r['instant_added_ttft_p50_ms'] <= GOALS['added_ttft_p50_ms'])} "
                     f"<= {GOALS['added_ttft_p50_ms']} ms)")
    if "sent" in r:
        lines.append(f"  fuzz         {r['sent']} malformed requests, statuses {r['statuses']}, "
                     f"5xx: {r['fuzz_5xx']} ({verdict(r['fuzz_5xx'] == 0)} = 0)")
    lines.append(f"  healthy after: {r['healthy_after']}")
    return "\n".join(lines)
