"""`specmesh soak`: many seeded streams against a stack, optionally while its processes are killed.

It asserts nothing about time. It reports, and its exit status says whether the
promise held: every output equals its undisturbed twin, and every error is
UNAVAILABLE (a failure may cost latency, or past the retry windows an
UNAVAILABLE that the caller retries; never a wrong or a lost token).

A run, in order:

1. The stack: the orchestrators at `--addr`, or one started here with the
   supervising launcher (by default 2 drafts, 2 verifiers and 2 orchestrators
   sharing an embedded Redis), which restarts whatever dies, as `specmesh up` does.
2. Warm-up: a few short streams, so that every process has loaded what it loads
   lazily; once the replicas hold no session, each process's resident memory
   (RSS) is read: its *baseline*.
3. Twins: each distinct request (`--unique` of them; a prompt, greedy or sampled
   at temperature 0.8, always with an explicit seed, 32 to 64 new tokens) runs
   once with no chaos, `--twin-concurrency` at a time (default 1: alone). Its
   output is the *twin* of every later stream of the same request.
4. Load: `--streams` streams cycling over the distinct requests in a shuffled
   order, `--concurrency` at a time, through specmesh.client.Client, which
   resumes a broken stream on any orchestrator. With `--chaos`, every
   `--chaos-every-s` one draft, verifier or orchestrator process gets SIGKILL
   (the tiers take turns, in a random order; the replica is random), never the
   last serving one of its tier: that would be an outage, not a failure to ride
   out. The launcher brings it back. `--chaos-kills N` stops killing after N
   (the load runs on; three kills reach every tier).
5. Settle: chaos stops, every process serves again, the replicas drop their
   sessions, `--settle-s` pass, and RSS is read again: *after*.

Why the twin is sound: with a seed, a session's tokens depend only on its
prompt, its parameters and the seed. Every random draw is keyed on (seed,
position), never on process state, and the verifier's batched forward pass
gives each session its logits alone to float rounding (tests/test_batching.py).
So a load stream that differs from its twin shows a failure handled wrong (a
lost, repeated or corrupted token, a cache that was not rebuilt right), or a
batch whose rounding decided a near-tie: the first is the bug this command
exists to find, the second is worth knowing too. Twins that run
alone also keep load and chaos out of the reference. `--reference FILE` takes
the twins from an earlier soak's JSON instead (the same prompts and --seed give
the same requests, which the prompt kept with each twin confirms), so a chaos
run can be checked against a calm one.

Writes soak.json and soak.png (resident memory per process; latency) to --out,
and prints a table. Exit status 1 when an output differs from its twin or has
none, or an error is not UNAVAILABLE.
"""
from __future__ import annotations

import json
import logging
import math
import random
import signal
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from specmesh import spec_bench
from specmesh_cli import client_args, launcher

log = logging.getLogger("specmesh.soak")

TIERS = ("draft", "verifier", "orchestrator")
SAMPLED_TEMPERATURE = 0.8
MAX_NEW_TOKENS = (32, 48, 64)

# Prompts for `--prompts generated`: short, so they fit any context (the tests' tiny models have 512).
_SUBJECTS = ("tides", "bread", "bicycles", "volcanoes", "libraries", "bees", "glaciers", "chess", "rain",
             "lighthouses", "compilers", "maps", "violins", "deserts", "caches", "owls")
_ASKS = ("explain in two sentences how {} work", "write a short poem about {}", "list three facts about {}",
         "describe {} to a child", "tell a very short story about {}")


def add_arguments(p) -> None:
    p.add_argument("--addr", action="append", default=[],
                   help="a running stack's orchestrator target, as specmesh.client.Client takes it (several "
                        "addresses in one target, e.g. ipv4:10.0.0.1:50051,10.0.0.2:50051); repeatable, streams "
                        "take them in turn. Default: start a stack here")
    client_args.add_client_arguments(p)
    p.add_argument("--model", default=None, help="target model of the stack started here (default: smollm2)")
    p.add_argument("--draft-model", default=None, help="its draft model (default: the target's shipped draft)")
    p.add_argument("--eagle-model", default=None, help="its EAGLE draft (default: the target's shipped one)")
    p.add_argument("--draft-replicas", type=int, default=2)
    p.add_argument("--verifier-replicas", type=int, default=2)
    p.add_argument("--orchestrator-replicas", type=int, default=2)
    launcher.add_thread_arguments(p)
    p.add_argument("--streams", type=int, default=200, help="streams in the load pass")
    p.add_argument("--concurrency", type=int, default=16, help="streams at once in the load pass")
    p.add_argument("--unique", type=int, default=32, help="distinct requests; the streams cycle over them")
    p.add_argument("--twin-concurrency", type=int, default=1, help="twins at once (1: each alone)")
    p.add_argument("--prompts", default=str(spec_bench.QUESTIONS),
                   help="a Spec-Bench style question.jsonl (first turns are the prompts; used as load only), or "
                        "'generated' for short built-in prompts")
    p.add_argument("--max-prompt-chars", type=int, default=800, help="longer questions are left out")
    p.add_argument("--no-chat", action="store_true", help="send the raw prompt instead of a chat turn")
    p.add_argument("--drafter", default="", help="drafter for every stream (default: the server's)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the server's)")
    p.add_argument("--seed", type=int, default=0, help="picks the prompts, the streams' order and the victims")
    p.add_argument("--chaos", action="store_true", help="SIGKILL a draft, verifier or orchestrator process "
                                                        "every --chaos-every-s (a stack started here only)")
    p.add_argument("--chaos-every-s", type=float, default=5.0)
    p.add_argument("--chaos-kills", type=int, default=0,
                   help="stop killing after this many kills; the load runs on (default 0: kill until it ends)")
    p.add_argument("--settle-s", type=float, default=5.0, help="idle time before resident memory is read")
    p.add_argument("--stream-timeout-s", type=float, default=600.0, help="deadline of one stream")
    p.add_argument("--reference", type=Path, default=None,
                   help="an earlier soak.json whose outputs are the twins (no twin pass)")
    p.add_argument("--out", type=Path, default=Path("soak_results"), help="folder for soak.json and soak.png")


@dataclass(frozen=True)
class SoakRequest:
    key: str
    prompt: str
    temperature: float
    seed: int
    max_new_tokens: int


@dataclass
class StreamResult:
    key: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""              # a gRPC status name; "" when the stream completed
    detail: str = ""
    ttft_s: float | None = None  # from the call to the first token
    per_token_s: float | None = None   # after the first token, per token
    elapsed_s: float = 0.0
    resumes: int = 0


def load_prompts(spec: str, max_chars: int, rng: random.Random) -> list[str]:
    if spec == "generated":
        prompts = [ask.format(subject) for subject in _SUBJECTS for ask in _ASKS]
    else:
        path = Path(spec)
        if not path.is_file():
            raise SystemExit(f"no prompts at {path}; pass --prompts FILE or --prompts generated")
        prompts = [q["turns"][0] for q in map(json.loads, filter(str.strip, path.read_text().splitlines()))]
        prompts = [p for p in prompts if len(p) <= max_chars]
    rng.shuffle(prompts)
    return prompts


def plan(prompts: list[str], unique: int, streams: int, rng: random.Random) -> tuple[list[SoakRequest], list[SoakRequest]]:
    """The distinct requests (half greedy, half sampled, all seeded) and the load's streams over them."""
    distinct = []
    for i in range(unique):
        temperature = 0.0 if i % 2 == 0 else SAMPLED_TEMPERATURE
        seed, max_new = 1000 + i, MAX_NEW_TOKENS[i % len(MAX_NEW_TOKENS)]
        kind = "greedy" if temperature == 0 else f"t{temperature}"
        distinct.append(SoakRequest(f"r{i}-{kind}-seed{seed}-n{max_new}", prompts[i % len(prompts)], temperature,
                                    seed, max_new))
    load = [distinct[i % unique] for i in range(streams)]
    rng.shuffle(load)
    return distinct, load


def run_stream(client, request: SoakRequest, args) -> StreamResult:
    from specmesh.client import build_request

    result = StreamResult(request.key)
    stream = client.stream(build_request(request.prompt, chat=not args.no_chat,
                                         max_new_tokens=request.max_new_tokens, temperature=request.temperature,
                                         seed=request.seed, k=args.k, drafter=args.drafter),
                           timeout=args.stream_timeout_s)
    started = time.perf_counter()
    first = None
    try:
        for chunk in stream:
            if chunk.token_ids and first is None:
                first = time.perf_counter()
            result.tokens.extend(chunk.token_ids)
            result.finish_reason = chunk.finish_reason or result.finish_reason
    except grpc.RpcError as error:
        result.error, result.detail = error.code().name, error.details() or ""
    ended = time.perf_counter()
    result.elapsed_s, result.resumes = ended - started, stream.resumes
    if first is not None:
        result.ttft_s = first - started
        if len(result.tokens) > 1 and not result.error:
            result.per_token_s = (ended - first) / (len(result.tokens) - 1)
    return result


class Stack:
    """The stack under load: its orchestrator targets and, when started here, its processes."""

    def __init__(self, args):
        self.cluster = None
        self.args = args
        self.kills: list[dict] = []
        self._rng = random.Random(args.seed + 1)
        self._turns: list[str] = []
        self._next_kill = float("inf")
        self.started = time.monotonic()

    def start(self) -> None:
        if self.args.addr:
            self.targets = list(self.args.addr)
            return
        from specmesh.drafts import draft_for, eagle_for
        from specmesh_cli.launcher import Cluster
        from specmesh_cli.ports import free_port

        self.cluster = Cluster(model=self.args.model, draft_model=draft_for(self.args.model, self.args.draft_model),
                          eagle_model=eagle_for(self.args.model, self.args.eagle_model),
                               port=free_port(), draft_replicas=self.args.draft_replicas,
                               verifier_replicas=self.args.verifier_replicas,
                               draft_torch_threads=self.args.draft_torch_threads,
                               verifier_torch_threads=self.args.verifier_torch_threads,
                               orchestrator_replicas=self.args.orchestrator_replicas,
                               log_dir=self.args.out / "logs", host="127.0.0.1")
        log.info("starting %d draft, %d verifier and %d orchestrator processes (logs in %s)",
                 self.args.draft_replicas, self.args.verifier_replicas, self.args.orchestrator_replicas,
                 self.args.out / "logs")
        self.cluster.start()
        ports = self.cluster.orchestrator_ports
        # One channel per orchestrator, each listing all of them from a different first one: the
        # streams spread over the orchestrators, and each channel fails over to the next.
        self.targets = ["ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports[i:] + ports[:i]) for i in range(len(ports))]

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()

    # --- processes, health and memory (a stack started here) ---

    def names(self) -> list[str]:
        return sorted(self.cluster.processes) if self.cluster else []

    def address(self, name: str) -> tuple[str, str]:
        tier, _, index = name.partition("-")
        ports = {"draft": self.cluster.draft_ports, "verifier": self.cluster.verifier_ports,
                 "orchestrator": self.cluster.orchestrator_ports}[tier]
        return f"localhost:{ports[int(index or 0)]}", f"specmesh.v1.{tier.capitalize()}"

    def serving(self, name: str) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        process = self.cluster.processes.get(name)
        if process is None or process.poll() is not None:
            return False
        address, service = self.address(name)
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def cached_sessions(self) -> dict[str, int | None]:
        from specmesh.v1 import cache_pb2, draft_pb2_grpc, verifier_pb2_grpc

        counts = {}
        for name in self.names():
            tier = name.partition("-")[0]
            if tier == "orchestrator":
                continue
            stub_cls = draft_pb2_grpc.DraftStub if tier == "draft" else verifier_pb2_grpc.VerifierStub
            try:
                with grpc.insecure_channel(self.address(name)[0]) as channel:
                    counts[name] = stub_cls(channel).Info(cache_pb2.InfoRequest(), timeout=5).cached_sessions
            except grpc.RpcError:
                counts[name] = None
        return counts

    def memory(self) -> dict[str, dict]:
        """Each process's pid and resident memory in MB, from /proc."""
        return {name: {"pid": self.cluster.processes[name].pid, "rss_mb": rss_mb(self.cluster.processes[name].pid)}
                for name in self.names()}

    def settle(self, quiet_s: float, timeout_s: float = 180.0) -> dict[str, int | None]:
        """Every process serving, no session cached on any replica, then `quiet_s` of quiet."""
        if self.cluster is None:
            time.sleep(quiet_s)
            return {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.cluster.supervise()
            if all(self.serving(name) for name in self.names()):
                break
            time.sleep(0.5)
        counts = self.cached_sessions()
        while any(counts.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            counts = self.cached_sessions()
        time.sleep(quiet_s)
        return counts

    # --- chaos ---

    def arm_chaos(self) -> None:
        self._next_kill = time.monotonic() + self.args.chaos_every_s

    def disarm_chaos(self) -> None:
        self._next_kill = float("inf")

    def tick(self) -> None:
        """From the thread that started the stack: restart the dead; kill one when it is time."""
        if self.cluster is None:
            return
        for name in self.cluster.supervise():
            log.info("chaos: %s restarted by the launcher", name)
        if time.monotonic() < self._next_kill:
            return
        if self.args.chaos_kills and len(self.kills) >= self.args.chaos_kills:
            return
        self._next_kill = time.monotonic() + self.args.chaos_every_s
        if not self._turns:
            self._turns = list(TIERS)
            self._rng.shuffle(self._turns)
        for tier in list(self._turns):
            peers = [n for n in self.names() if n.partition("-")[0] == tier]
            # Only when the whole tier serves: killing its last live replica is an outage, not chaos.
            if len(peers) < 2 or not all(self.serving(n) for n in peers):
                continue
            self._turns.remove(tier)
            victim = self._rng.choice(peers)
            process = self.cluster.processes[victim]
            process.send_signal(signal.SIGKILL)
            self.kills.append({"at_s": round(time.monotonic() - self.started, 2), "process": victim,
                               "pid": process.pid})
            log.warning("chaos: SIGKILL %s (pid %d)", victim, process.pid)
            return
        log.info("chaos: no tier has all its replicas serving; no kill this time")


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_pass(stack: Stack, clients: list, requests: list, concurrency: int, args, what: str) -> tuple[list, float]:
    """Run `requests`, `concurrency` at a time; the calling thread ticks the stack meanwhile."""
    results, started = [], time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        pending = {pool.submit(run_stream, clients[i % len(clients)], r, args) for i, r in enumerate(requests)}
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for future in done:
                results.append(future.result())
                r = results[-1]
                print(f"[{what} {len(results)}/{len(requests)}] {r.key:<28} {len(r.tokens):3d} tok "
                      f"{r.finish_reason or r.error:<12} resumes {r.resumes}", file=sys.stderr, flush=True)
            stack.tick()
    return results, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


def compare(results: list[StreamResult], twins: dict[str, dict]) -> dict:
    """Each completed stream against its twin: tokens and finish reason."""
    equal, differ, unchecked = 0, [], []
    for r in results:
        if r.error:
            continue
        twin = twins.get(r.key)
        if twin is None:
            unchecked.append(r.key)
        elif twin["tokens"] == r.tokens and twin["finish_reason"] == r.finish_reason:
            equal += 1
        else:
            n = next((i for i, (a, b) in enumerate(zip(twin["tokens"], r.tokens)) if a != b),
                     min(len(twin["tokens"]), len(r.tokens)))
            differ.append({"key": r.key, "first_difference_at": n, "twin_tokens": len(twin["tokens"]),
                           "tokens": len(r.tokens), "twin_finish": twin["finish_reason"],
                           "finish": r.finish_reason})
    return {"completed": equal + len(differ) + len(unchecked), "equal": equal, "differ": differ,
            "unchecked": unchecked}


def summarize(results: list[StreamResult], wall_s: float) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    return {"streams": len(results), "errors": dict(Counter(r.error for r in results if r.error)),
            "error_details": sorted({f"{r.error}: {r.detail}" for r in results if r.error})[:20],
            "resumes": sum(r.resumes for r in results), "resumed_streams": sum(r.resumes > 0 for r in results),
            "ttft_p50_s": percentile([r.ttft_s for r in results], 50),
            "ttft_p99_s": percentile([r.ttft_s for r in results], 99),
            "per_token_p50_s": percentile([r.per_token_s for r in results], 50),
            "per_token_p99_s": percentile([r.per_token_s for r in results], 99),
            "tokens": tokens, "wall_s": wall_s, "tokens_per_second": tokens / wall_s if wall_s else 0.0}


def run(args) -> int:

    rng = random.Random(args.seed)
    if args.chaos and args.addr:
        raise SystemExit("--chaos kills processes of a stack started here; leave out --addr")
    if args.chaos_kills < 0:
        raise SystemExit(f"--chaos-kills {args.chaos_kills}: expected 0 (no limit) or more")
    prompts = load_prompts(args.prompts, args.max_prompt_chars, rng)
    distinct, load = plan(prompts, min(args.unique, args.streams), args.streams, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    stack, phases = Stack(args), {}
    clock = time.perf_counter()

    def phase(name: str) -> None:   # the wall time of each phase, so a slow run shows where it went
        nonlocal clock
        phases[name], clock = round(time.perf_counter() - clock, 1), time.perf_counter()

    try:
        stack.start()
    except Exception as error:  # noqa: BLE001 - tell the person, not a traceback
        log.error("start-up failed: %s", error)
        stack.stop()
        return 1
    phase("start-up")
    report: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                               if k != "token_file"}}
    clients = [client_args.client_for(args, target) for target in stack.targets]
    try:
        memory = {"start": stack.memory()}
        warmup = [SoakRequest(f"warmup-{i}", prompts[i % len(prompts)], 0.0, i, 8) for i in range(4)]
        run_pass(stack, clients, warmup, 2, args, "warm-up")
        stack.settle(args.settle_s)
        memory["baseline"] = stack.memory()
        phase("warm-up")
        if args.reference:   # only twins of the very same requests count (same prompts and --seed)
            wanted = {r.key: r.prompt for r in distinct}
            twins = {key: twin for key, twin in json.loads(args.reference.read_text())["twins"].items()
                     if twin.get("prompt") == wanted.get(key)}
            twin_summary = {"from": str(args.reference)}
        else:
            twin_results, twin_wall = run_pass(stack, clients, distinct, args.twin_concurrency, args, "twin")
            prompt_of = {r.key: r.prompt for r in distinct}
            twins = {r.key: {"prompt": prompt_of[r.key], "tokens": r.tokens, "finish_reason": r.finish_reason}
                     for r in twin_results if not r.error}
            twin_summary = summarize(twin_results, twin_wall)
            stack.settle(args.settle_s)
            memory["after_twins"] = stack.memory()
        phase("twins")
        if args.chaos:
            stack.arm_chaos()
        load_results, load_wall = run_pass(stack, clients, load, args.concurrency, args, "load")
        stack.disarm_chaos()
        phase("load")
        cached_after = stack.settle(args.settle_s)
        memory["after"] = stack.memory()
        phase("settle")
    finally:
        for client in clients:
            client.close()
        stack.stop()
    report.update({"phases_s": phases, "twins": twins, "kills": stack.kills, "twin_pass": twin_summary, "load": summarize(load_results, load_wall),
                   "outputs": compare(load_results, twins), "cached_sessions_after": cached_after,
                   "memory": memory_table(memory), "streams": [asdict(r) for r in load_results]})
    failed = print_report(report)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report, load_results, args.out / "soak.png")
    print(f"wrote {args.out / 'soak.json'}, {args.out / 'soak.png'}")
    return 1 if failed else 0


def memory_table(memory: dict) -> list[dict]:
    """Per process: RSS at start, at baseline, after the twins and after the load; restarted = a new pid."""
    rows = []
    for name in memory["start"]:
        row = {"process": name}
        for phase in ("start", "baseline", "after_twins", "after"):
            entry = (memory.get(phase) or {}).get(name)
            row[f"{phase}_mb"] = entry["rss_mb"] if entry else None
            row[f"{phase}_pid"] = entry["pid"] if entry else None
        row["restarted"] = row["after_pid"] != row["baseline_pid"]
        row["after_over_baseline"] = (row["after_mb"] / row["baseline_mb"]
                                      if row["after_mb"] and row["baseline_mb"] and not row["restarted"] else None)
        rows.append(row)
    return rows


def _s(value: float | None, unit: str = " s") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


def print_report(report: dict) -> bool:
    """The table; returns whether the run failed (an output differs or is unchecked, or a non-UNAVAILABLE error)."""
    c, load, out = report["config"], report["load"], report["outputs"]
    kills = Counter(k["process"].partition("-")[0] for k in report["kills"])
    most = f", at most {c['chaos_kills']}" if c.get("chaos_kills") else ""
    chaos = (f"every {c['chaos_every_s']:g} s{most}, {len(report['kills'])} kills "
             f"({', '.join(f'{n} {t}' for t, n in sorted(kills.items())) or 'none'})" if c["chaos"] else "off")
    print(f"\nsoak: {load['streams']} streams over {len(report['twins'])} twinned requests, concurrency "
          f"{c['concurrency']}; chaos: {chaos}")
    print("wall time by phase: " + ", ".join(f"{name} {s:g} s" for name, s in report["phases_s"].items()))
    twin = report["twin_pass"]
    if "streams" in twin:
        print(f"twins (concurrency {c['twin_concurrency']}, no chaos): {twin['streams']} streams, "
              f"{twin['tokens_per_second']:.1f} tokens/s, errors: {twin['errors'] or 'none'}")
    bad_errors = {code: n for code, n in load["errors"].items() if code != "UNAVAILABLE"}
    print(f"outputs equal to their twins: {out['equal']} of {out['completed']} completed "
          f"({len(out['differ'])} differ, {len(out['unchecked'])} without a twin)")
    print(f"errors by status: {load['errors'] or 'none'}")
    for line in load["error_details"]:
        print(f"  {line}")
    print(f"resumes: {load['resumes']} (in {load['resumed_streams']} streams)")
    print(f"time to first token: p50 {_s(load['ttft_p50_s'])}, p99 {_s(load['ttft_p99_s'])}; per token: "
          f"p50 {_s(load['per_token_p50_s'])}, p99 {_s(load['per_token_p99_s'])}")
    print(f"tokens/s overall: {load['tokens_per_second']:.1f} ({load['tokens']} tokens in {load['wall_s']:.0f} s)")
    if report["memory"]:
        print("resident memory, MB (baseline: after warm-up; after: load over, sessions released, then quiet):")
        print(f"  {'process':<16}{'start':>8}{'baseline':>10}{'twins':>8}{'after':>8}{'after/baseline':>16}")
        for m in report["memory"]:
            ratio = ("restarted" if m["restarted"] else
                     "-" if m["after_over_baseline"] is None else f"{m['after_over_baseline']:.2f}")
            mb = {p: "-" if m[f"{p}_mb"] is None else f"{m[f'{p}_mb']:.0f}"
                  for p in ("start", "baseline", "after_twins", "after")}
            print(f"  {m['process']:<16}{mb['start']:>8}{mb['baseline']:>10}{mb['after_twins']:>8}{mb['after']:>8}"
                  f"{ratio:>16}")
        print(f"cached sessions after: {report['cached_sessions_after']}")
    failed = bool(out["differ"] or out["unchecked"] or bad_errors)
    print("PASS: every output equals its twin, every error is UNAVAILABLE" if not failed else
          f"FAIL: {len(out['differ'])} outputs differ, {len(out['unchecked'])} without a twin, "
          f"errors other than UNAVAILABLE: {bad_errors or 'none'}")
    return failed


def plot(report: dict, results: list[StreamResult], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:   # the plot is a nicety
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = report["memory"]
    if rows:
        xs = range(len(rows))
        for offset, phase in ((-0.3, "start"), (-0.1, "baseline"), (0.1, "after_twins"), (0.3, "after")):
            ax1.bar([x + offset for x in xs], [m[f"{phase}_mb"] or 0 for m in rows], 0.2, label=phase)
        ax1.set_xticks(list(xs), [m["process"] + (" *" if m["restarted"] else "") for m in rows], rotation=30,
                       ha="right")
        ax1.set_ylabel("resident memory, MB")
        ax1.set_title("memory per process (* restarted by chaos)")
        ax1.set_ylim(0, 1.3 * max(m[f"{p}_mb"] or 0 for m in rows for p in ("start", "baseline", "after")))
        ax1.legend(fontsize="small", ncol=4, loc="upper center")
    for values, label in (([r.ttft_s for r in results if r.ttft_s is not None], "time to first token"),
                          ([r.per_token_s for r in results if r.per_token_s is not None], "per token")):
        if values:
            values = sorted(values)
            ax2.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax2.set_xscale("log")
    ax2.set_xlabel("seconds")
    ax2.set_title("latency, load pass (CDF)")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
