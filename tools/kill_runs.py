"""kill -9 mid-stream, again and again: is the output still the undisturbed one?

    python -m tools.kill_runs                          # default model, 20 runs per tier
    python -m tools.kill_runs --runs 5 --tiers verifier --max-new-tokens 32

Starts a stack with two replicas of every tier (draft, verifier, orchestrator)
under the supervising launcher. Each run streams one completion (alternately
greedy and sampled at temperature 0.8, seed = the run's number) through a
client that names both orchestrators; once `--kill-after` tokens have arrived
it SIGKILLs the process serving the stream: the orchestrator the client is
connected to, or the draft or verifier replica that holds the session's cache
(the one whose Info reports a cached session). The killed process is brought
back before the next run. A run passes when the joined output equals the same
request run undisturbed, token for token. Prints a line per run and a table;
exits 1 if any run differs or fails.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from specmesh.client import Client, build_request
from specmesh.v1 import cache_pb2, draft_pb2_grpc, verifier_pb2_grpc
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port

PROMPTS = ["Explain how a hash map handles collisions.", "Write a short story about a lighthouse keeper.",
           "List five tips for learning a new language.", "Describe the water cycle to a child."]
STUBS = {"draft": draft_pb2_grpc.DraftStub, "verifier": verifier_pb2_grpc.VerifierStub}


def holder(cluster: Cluster, tier: str) -> str:
    """The replica of `tier` that caches a session now (the stream's), by its Info."""
    ports = cluster.draft_ports if tier == "draft" else cluster.verifier_ports
    for i, port in enumerate(ports):
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            if STUBS[tier](channel).Info(cache_pb2.InfoRequest(), timeout=10).cached_sessions > 0:
                return f"{tier}-{i}"
    return f"{tier}-0"


def one_run(cluster: Cluster, tier: str, run: int, args) -> dict:
    prompt = PROMPTS[run % len(PROMPTS)]
    params = dict(chat=True, max_new_tokens=args.max_new_tokens, temperature=0.0 if run % 2 else 0.8, seed=run)
    with Client(f"localhost:{cluster.orchestrator_ports[1]}") as client:
        reference = client.generate(prompt, **params).token_ids
    tokens, victim, resumes = [], None, 0
    with Client(cluster.target) as client:
        stream = client.stream(build_request(prompt, **params))
        for chunk in stream:
            tokens += chunk.token_ids
            if victim is None and len(tokens) >= args.kill_after:
                victim = "orchestrator" if tier == "orchestrator" else holder(cluster, tier)
                cluster.stop_tier(victim, signal.SIGKILL)
        resumes = getattr(stream, "resumes", 0)
    cluster.start_tier(victim or tier)
    cluster.wait()
    first_difference = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                            None if len(tokens) == len(reference) else min(len(tokens), len(reference)))
    return {"tier": tier, "run": run, "victim": victim, "temperature": params["temperature"], "tokens": len(tokens),
            "identical": tokens == reference, "first_difference": first_difference, "resumes": resumes,
            "output": tokens, "reference": reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    parser.add_argument("--draft-model", default=None, help="default: the shipped draft of the default target")
    parser.add_argument("--runs", type=int, default=20, help="runs per tier")
    parser.add_argument("--first-run", type=int, default=1, help="number of the first run (its seed)")
    parser.add_argument("--tiers", default="orchestrator,verifier,draft")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--kill-after", type=int, default=12, help="tokens received before the kill")
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    from specmesh.drafts import draft_for

    logs = Path(tempfile.mkdtemp(prefix="specmesh-kill-runs-"))
    cluster = Cluster(model=args.model, draft_model=draft_for(args.model, args.draft_model), port=free_port(),
                      draft_replicas=2, verifier_replicas=2, orchestrator_replicas=2, log_dir=logs)
    print(f"starting 2 drafts, 2 verifiers, 2 orchestrators (logs in {logs})", flush=True)
    results = []
    with cluster:
        for tier in args.tiers.split(","):
            for run in range(args.first_run, args.first_run + args.runs):
                started = time.monotonic()
                try:
                    result = one_run(cluster, tier, run, args)
                except grpc.RpcError as error:
                    result = {"tier": tier, "run": run, "identical": False, "error": error.code().name}
                    cluster.supervise()
                    cluster.wait()
                results.append(result)
                print(f"[{tier} {run}] killed {result.get('victim')} after {args.kill_after} tokens: "
                      f"{'identical' if result['identical'] else 'DIFFERENT'} "
                      f"({result.get('error') or str(result.get('tokens')) + ' tokens'}, "
                      f"{time.monotonic() - started:.0f} s)", flush=True)
    print("\ntier          identical / runs")
    for tier in args.tiers.split(","):
        rows = [r for r in results if r["tier"] == tier]
        print(f"{tier:13s} {sum(r['identical'] for r in rows):>9d} / {len(rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
