"""Where a decoding step's time goes, per bench configuration, from the services' traces.

    python -m tools.step_split -- --question-ids 121,241 --configs ngram:4,model:4 --out OUT

runs `specmesh bench` with those arguments, its services exporting spans over
OTLP to a collector in this process (tools/otlp_collector.py), then splits them.

Each orchestrator `step` span is split into the draft model's time
(`engine.propose` in the draft service), the target's (`engine.verify_batch`
in the verifier) and the rest (gRPC, (de)serialization, the accept rule, the
Redis commit, queueing): the service overhead of the cost model in
docs/benchmarks.md. That rest is an upper bound: the services run traced
here, and the tracing's interceptors and span export cost a speculative step
a few milliseconds of their own. `python -m tools.rpc_cost` measures an RPC's
cost untraced (0.15 ms beyond a bare gRPC call on the AMD EPYC build machine).
Traces are matched to the bench's own rows in order (the first trace is the
bench's untimed warm-up request).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from tools.otlp_collector import Collector


def main() -> None:
    args = sys.argv[1:]
    args = args[1:] if args[:1] == ["--"] else args
    out = Path(args[args.index("--out") + 1]) if "--out" in args else Path("bench_results")
    with Collector() as collector:
        subprocess.run([sys.executable, "-m", "specmesh_cli.cli", "bench", *args], check=True,
                       env={**os.environ, **collector.env()})
        time.sleep(2)   # the last batches of spans
        spans = collector.spans()
    split(spans, out / "results.json")


def split(spans: list[dict], results: Path) -> None:
    by_id = {s["span_id"]: s for s in spans}
    steps = [s for s in spans if s["name"] == "step"]
    step_ids = {s["span_id"] for s in steps}

    def owning_step(span):
        while span is not None and span["span_id"] not in step_ids:
            span = by_id.get(span.get("parent_span_id"))
        return span["span_id"] if span else None

    parts = defaultdict(lambda: defaultdict(float))   # step id -> part -> seconds
    for s in spans:
        part = {"engine.propose": "draft", "engine.verify_batch": "verify"}.get(s["name"])
        # A verifier pass is its own span, linked to the Verify calls it served.
        for origin in ([s] if part == "draft" else [by_id[i] for i in s.get("links", []) if i in by_id]):
            step = owning_step(origin)
            if step:
                parts[step][part] += (s["end_ns"] - s["start_ns"]) / 1e9
    traces = defaultdict(list)
    for s in steps:
        traces[s["trace_id"]].append(s)
    ordered = sorted(traces.values(), key=lambda t: min(s["start_ns"] for s in t))
    rows = [r for r in json.loads(results.read_text())["runs"] if not r["config"].startswith("hf:")]
    if len(ordered) == len(rows) + 1:
        ordered = ordered[1:]                          # the warm-up request
    if len(ordered) != len(rows):
        raise SystemExit(f"{len(ordered)} traced requests but {len(rows)} bench rows")
    table = defaultdict(lambda: defaultdict(list))
    for row, trace in zip(rows, ordered):
        for s in trace:
            total = (s["end_ns"] - s["start_ns"]) / 1e9
            p = parts[s["span_id"]]
            t = table[row["config"]]
            t["total"].append(total)
            t["draft"].append(p["draft"])
            t["verify"].append(p["verify"])
            t["other"].append(total - p["draft"] - p["verify"])
            t["tokens"].append(s["attributes"].get("specmesh.committed_tokens", 0))
            t["k"].append(s["attributes"].get("specmesh.draft_tokens", 0))
    print(f"{'config':<14}{'steps':>7}{'tok/step':>9}{'ms/step':>9}{'draft':>8}{'verify':>8}{'other':>8}"
          f"{'draft ms/tok':>13}")
    for config, t in table.items():
        mean = {k: statistics.mean(v) for k, v in t.items()}
        drafted = sum(t["k"])
        print(f"{config:<14}{len(t['total']):>7}{sum(t['tokens']) / len(t['total']):>9.2f}{mean['total'] * 1e3:>9.1f}"
              f"{mean['draft'] * 1e3:>8.1f}{mean['verify'] * 1e3:>8.1f}{mean['other'] * 1e3:>8.1f}"
              f"{(sum(t['draft']) / drafted * 1e3 if drafted else 0):>13.2f}")


if __name__ == "__main__":
    main()
