"""Observability across the three processes: one trace per Generate, the
Prometheus endpoints, log correlation, and nothing installed when tracing is off.

One cluster (tiny random models) runs with tracing exported over OTLP to a
collector in this process and a metrics port per process; one request and one
bad request go through it, and the tests read what the three processes recorded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specmesh import telemetry
from specmesh.engine_host import EngineHost
from specmesh.client import Client, Completion, build_request
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from tools.otlp_collector import Collector

GENERATE = "/specmesh.v1.Orchestrator/Generate"
PROPOSE = "/specmesh.v1.Draft/Propose"
VERIFY = "/specmesh.v1.Verifier/Verify"
PREFILL = "/specmesh.v1.Verifier/Prefill"


def _clean_env() -> dict[str, str]:
    """This environment without OTEL_* / SPECMESH_* settings that would change what is tested."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("OTEL_") and k != "SPECMESH_METRICS_PORT"}


@pytest.fixture(scope="module")
def observed(tmp_path_factory, tiny_models, redis_url):
    """A traced, metered cluster after one good request (k=3, 24 tokens) and one bad one (k=-1)."""
    root = tmp_path_factory.mktemp("telemetry")
    collector = Collector().__enter__()
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=root / "logs", startup_timeout_s=900, metrics=True,
                      extra_env={**collector.env(), "SPECMESH_LOG_FORMAT": "json",
                                 # Only this collector, whatever this environment says about OTel.
                                 "OTEL_SERVICE_NAME": "", "OTEL_RESOURCE_ATTRIBUTES": "", "OTEL_SDK_DISABLED": "",
                                 "OTEL_TRACES_SAMPLER": "", "SPECMESH_METRICS_PORT": ""})
    cluster.start()
    try:
        completion, steps = Completion(), []
        with Client(cluster.address) as client:
            for chunk in client.stream(build_request("hello world", max_new_tokens=24, k=3)):
                completion.add(chunk)
                if chunk.token_ids:
                    steps.append(chunk.step)
            with pytest.raises(grpc.RpcError) as bad:
                client.generate("hello world", max_new_tokens=24, k=-1)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        yield {"cluster": cluster, "completion": completion, "steps": steps, "collector": collector,
               "logs": root / "logs"}
    finally:
        cluster.stop()
        collector.__exit__()


def _scrape(cluster: Cluster, name: str) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} from one process's /metrics."""
    text = urllib.request.urlopen(cluster.metrics_url(name), timeout=10).read().decode()
    samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples


def _value(samples, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for l, v in samples.get(name, []) if all(l.get(k) == want for k, want in labels.items()))


def _trace_of(observed, timeout_s: float = 30.0) -> tuple[dict, list[dict], list[dict]]:
    """The Generate server span of the good request, every span of its trace, and every span received."""
    session_id = observed["completion"].session_id
    deadline = time.monotonic() + timeout_s
    while True:
        spans = observed["collector"].spans()
        roots = [s for s in spans if s["name"] == GENERATE and s["kind"] == "SERVER"
                 and s["attributes"].get(telemetry.ATTR_SESSION) == session_id]
        if roots or time.monotonic() > deadline:
            break
        time.sleep(0.2)   # the server span ends just after the client saw the last chunk
    assert len(roots) == 1, f"no Generate span for session {session_id}"
    root = roots[0]
    time.sleep(0.5)   # the draft's and verifier's batches of the same trace may still be on their way
    spans = observed["collector"].spans()
    return root, [s for s in spans if s["trace_id"] == root["trace_id"]], spans


def test_one_trace_spans_the_three_processes(observed):
    stats = observed["completion"].stats
    root, spans, everything = _trace_of(observed)
    by_id = {s["span_id"]: s for s in spans}
    children = defaultdict(list)
    for s in spans:
        children[s["parent_span_id"]].append(s)

    assert root["tier"] == "orchestrator" and root["parent_span_id"] is None   # the client is not traced
    assert {s["service"] for s in spans} == {"specmesh-orchestrator", "specmesh-draft", "specmesh-verifier"}

    # Generate -> Prefill (client) and one `step` span per step, numbered, carrying the step's counts.
    top = children[root["span_id"]]
    assert [s["name"] for s in top if s["kind"] == "CLIENT"].count(PREFILL) == 1
    steps = sorted((s for s in top if s["name"] == telemetry.SPAN_STEP), key=lambda s: s["start_ns"])
    assert len(steps) == stats.steps > 0
    assert [s["attributes"][telemetry.ATTR_STEP] for s in steps] == list(range(1, stats.steps + 1))
    assert sum(s["attributes"][telemetry.ATTR_DRAFT_TOKENS] for s in steps) == stats.draft_tokens
    assert sum(s["attributes"][telemetry.ATTR_ACCEPTED_TOKENS] for s in steps) == stats.accepted_tokens
    assert [(s["attributes"][telemetry.ATTR_DRAFT_TOKENS], s["attributes"][telemetry.ATTR_ACCEPTED_TOKENS],
             s["attributes"][telemetry.ATTR_BONUS]) for s in steps] == \
        [(c.draft_tokens, c.accepted_tokens, c.bonus) for c in observed["steps"]]

    for step in steps:
        names = [(c["kind"], c["name"]) for c in children[step["span_id"]]]
        assert names.count(("INTERNAL", telemetry.SPAN_ACCEPT)) == 1
        assert names.count(("INTERNAL", telemetry.SPAN_COMMIT)) == 1
        assert names.count(("CLIENT", VERIFY)) == 1
        assert names.count(("CLIENT", PROPOSE)) == (1 if step["attributes"][telemetry.ATTR_K] > 0 else 0)
        for client in children[step["span_id"]]:
            if client["kind"] != "CLIENT":
                continue
            # Each client span's child is the server span in the draft or verifier process ...
            (server,) = children[client["span_id"]]
            assert server["kind"] == "SERVER" and server["name"] == client["name"]
            assert server["tier"] == ("draft" if client["name"] == PROPOSE else "verifier")
            assert server["status"] != "ERROR"
            if client["name"] == PROPOSE:   # ... and under it the model-thread work,
                (engine,) = children[server["span_id"]]
                assert engine["name"] == "engine.propose"
            else:   # or, for a Verify (batched), the one batch span linked to it: its own trace, shared by callers
                assert not children[server["span_id"]]
                (engine,) = [s for s in everything if server["span_id"] in s["links"]]
                assert engine["name"] == "engine.verify_batch" and engine["parent_span_id"] is None
                assert engine["attributes"][telemetry.ATTR_BATCH_SIZE] == len(engine["links"]) == 1
            assert engine["attributes"][telemetry.ATTR_QUEUE_WAIT] >= 0

    # A step begins, with its Propose, during the last step's commit (Decoder._propose_ahead): the draft
    # works while Redis commits and the stream writes.
    for before, after in zip(steps, steps[1:]):
        if after["attributes"][telemetry.ATTR_K] > 0:
            (commit,) = [c for c in children[before["span_id"]] if c["name"] == telemetry.SPAN_COMMIT]
            (propose,) = [c for c in children[after["span_id"]] if c["name"] == PROPOSE]
            assert before["start_ns"] < after["start_ns"] <= propose["start_ns"] < commit["end_ns"]
            assert engine["start_ns"] >= server["start_ns"] and engine["end_ns"] <= server["end_ns"]

    # Every span hangs off the Generate span: nothing is orphaned.
    for s in spans:
        if s is not root:
            assert s["parent_span_id"] in by_id, s["name"]
    # Prompts and outputs go into no span.
    text = json.dumps(spans)
    assert "hello world" not in text and observed["completion"].text not in text


def test_a_rejected_call_carries_its_status_code(observed):
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    deadline = time.monotonic() + 30
    while True:
        rejected = [s for s in observed["collector"].spans()
                    if s["name"] == GENERATE and s["attributes"].get("rpc.grpc.status_code") == invalid]
        if rejected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rejected) == 1                                 # the k=-1 request
    # OTel conventions: a client's mistake is no server error (only INTERNAL, UNAVAILABLE, ... set ERROR).
    assert rejected[0]["status"] != "ERROR" and rejected[0]["kind"] == "SERVER"


def test_logs_carry_trace_and_session(observed):
    root, _, _ = _trace_of(observed)
    session_id = observed["completion"].session_id
    lines = [json.loads(line) for line in (observed["logs"] / "orchestrator.log").read_text().splitlines()
             if line.startswith("{")]
    finished = [e for e in lines if e["message"].startswith("session finished")]
    assert finished, "the orchestrator logs one line per finished session"
    mine = [e for e in finished if e.get("session_id") == session_id]
    assert len(mine) == 1
    assert mine[0]["trace_id"] == root["trace_id"] and len(mine[0]["span_id"]) == 16
    # Nothing logged carries the prompt or the output.
    for log_file in observed["logs"].glob("*.log"):
        text = log_file.read_text()
        assert "hello world" not in text
        assert observed["completion"].text not in text


def test_metrics_match_the_run(observed):
    cluster, stats, steps = observed["cluster"], observed["completion"].stats, observed["steps"]
    o = _scrape(cluster, "orchestrator")
    drafter = {"drafter": "model"}
    assert _value(o, "specmesh_steps_total", **drafter) == stats.steps > 0
    assert _value(o, "specmesh_committed_tokens_total", **drafter) == stats.committed_tokens == 24
    assert _value(o, "specmesh_prompt_tokens_total", **drafter) == stats.prompt_tokens
    drafted = _value(o, "specmesh_spec_decode_num_draft_tokens_total", **drafter)
    accepted = _value(o, "specmesh_spec_decode_num_accepted_tokens_total", **drafter)
    assert (drafted, accepted) == (stats.draft_tokens, stats.accepted_tokens)
    assert 0 <= accepted <= drafted and drafted > 0
    assert _value(o, "specmesh_spec_decode_num_drafts_total", **drafter) == sum(1 for s in steps if s.draft_tokens)
    per_pos = {int(l["position"]): v for l, v in o["specmesh_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert sum(per_pos.values()) == accepted
    assert all(per_pos[p] >= per_pos[p + 1] for p in per_pos if p + 1 in per_pos)   # a prefix is accepted
    assert _value(o, "specmesh_request_success_total", finished_reason="length") == 1
    for histogram in ("specmesh_time_to_first_token_seconds", "specmesh_time_per_output_token_seconds",
                      "specmesh_e2e_request_latency_seconds"):
        assert _value(o, f"{histogram}_count", **drafter) == 1, histogram
    assert 0 < _value(o, "specmesh_time_to_first_token_seconds_sum") <= _value(o, "specmesh_e2e_request_latency_seconds_sum")
    assert _value(o, "specmesh_step_duration_seconds_count") == stats.steps
    assert _value(o, "specmesh_orchestrator_active_sessions") == 0
    assert _value(o, "specmesh_rpc_requests_total", method=GENERATE, code="OK") == 1
    assert _value(o, "specmesh_rpc_errors_total", method=GENERATE, code="INVALID_ARGUMENT") == 1
    assert _value(o, "specmesh_rpc_errors_total", method=GENERATE) == 1

    v = _scrape(cluster, "verifier")
    assert _value(v, "specmesh_rpc_requests_total", method=VERIFY, code="OK", tier="verifier") == stats.steps
    assert _value(v, "specmesh_rpc_requests_total", method=PREFILL, code="OK") == 1
    assert _value(v, "specmesh_rpc_errors_total") == 0
    assert _value(v, "specmesh_engine_call_duration_seconds_count", method="verify_batch") == stats.steps
    assert _value(v, "specmesh_engine_queue_wait_seconds_count", method="verify_batch") == stats.steps
    assert _value(v, "specmesh_verifier_queue_depth", tier="verifier") == 0
    assert _value(v, "specmesh_cached_sessions", tier="verifier") == 0      # released at the end
    assert _value(v, "specmesh_kv_cache_bytes", tier="verifier") == 0

    d = _scrape(cluster, "draft")
    assert _value(d, "specmesh_rpc_requests_total", method=PROPOSE, code="OK", tier="draft") == \
        sum(1 for s in steps if s.draft_tokens)
    assert _value(d, "specmesh_draft_queue_depth", tier="draft") == 0
    assert _value(d, "specmesh_cached_sessions", tier="draft") == 0

    # An error counted by code on the tier that answered it.
    with grpc.insecure_channel(f"localhost:{cluster.verifier_port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Prefill(verifier_pb2.PrefillRequest(session_id="", token_ids=[1]), timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    v = _scrape(cluster, "verifier")
    assert _value(v, "specmesh_rpc_errors_total", method=PREFILL, code="INVALID_ARGUMENT", tier="verifier") == 1


def test_kv_cache_gauges_follow_sessions(observed):
    cluster = observed["cluster"]
    with grpc.insecure_channel(f"localhost:{cluster.verifier_port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        stub.Prefill(verifier_pb2.PrefillRequest(session_id="kv-gauge", token_ids=[5, 6, 7, 8, 9, 10]), timeout=30)
        try:
            v = _scrape(cluster, "verifier")
            assert _value(v, "specmesh_cached_sessions", tier="verifier") == 1
            held = _value(v, "specmesh_kv_cache_bytes", tier="verifier")
            assert held > 0
        finally:
            from specmesh.v1 import cache_pb2

            stub.Release(cache_pb2.ReleaseRequest(session_id="kv-gauge"), timeout=30)
    v = _scrape(cluster, "verifier")
    assert _value(v, "specmesh_cached_sessions", tier="verifier") == 0
    assert _value(v, "specmesh_kv_cache_bytes", tier="verifier") == 0


def test_tracing_off_installs_nothing():
    """Without OTEL_*: the API's proxy provider, no interceptors, no-op spans that cost ~µs."""
    script = textwrap.dedent("""
        import asyncio, json, sys, time
        from opentelemetry import metrics, trace
        from specmesh import telemetry
        telemetry.setup("orchestrator", None)
        import orchestrator.server, draft_service.server, verifier_service.server
        from specmesh.engine_host import EngineHost
        from specmesh.server import ServiceRuntime

        async def runtime_interceptors():
            runtime = ServiceRuntime(["specmesh.v1.Draft"], 0)
            host = EngineHost("x")
            host.engine = type("E", (), {"ping": lambda self: 1})()
            assert await host.run(host.engine.ping) == 1 and host.depth == 0
            return [type(i).__name__ for i in runtime.interceptors]

        tracer = telemetry.tracer()
        n = 20000
        started = time.perf_counter()
        for _ in range(n):
            with tracer.start_as_current_span("step") as span:
                with tracer.start_as_current_span("accept"):
                    pass
                recording = span.is_recording()
            telemetry.record_step("model", 3, 1, False, 2, 0.1, None)
        per_step_us = (time.perf_counter() - started) / n * 1e6
        print(json.dumps({
            "tracer_provider": type(trace.get_tracer_provider()).__name__,
            "meter_provider": type(metrics.get_meter_provider()).__name__,
            "tracing": telemetry.tracing_enabled(), "metrics": telemetry.metrics_enabled(),
            "server": telemetry.server_interceptors(), "client": telemetry.client_interceptors(),
            "runtime": asyncio.run(runtime_interceptors()),
            "instrumentation_loaded": "opentelemetry.instrumentation.grpc" in sys.modules,
            "recording": recording, "per_step_us": per_step_us}))
    """)
    out = subprocess.run([sys.executable, "-c", script], env=_clean_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["tracer_provider"] == "ProxyTracerProvider"
    assert report["meter_provider"] in ("_ProxyMeterProvider", "NoOpMeterProvider")
    assert not report["tracing"] and not report["metrics"]
    assert report["server"] == [] and report["client"] == []
    assert report["runtime"] == ["StatusInterceptor"]
    assert not report["instrumentation_loaded"] and not report["recording"]
    assert report["per_step_us"] < 500, report   # ~10 µs on a laptop; a step is milliseconds


@pytest.mark.parametrize("environ, expected", [
    ({}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_exporters_follow_the_environment(environ, expected):
    assert telemetry.trace_exporters(environ) == expected


def test_cache_nbytes_counts_dynamic_cache_tensors(tiny_models):
    from specmesh.kv import KVSession, cache_nbytes
    from specmesh.models import load_model

    loaded = load_model(str(tiny_models["target"]))
    session = KVSession("s", loaded.model)
    assert cache_nbytes(session.cache) == 0
    session.sync(0, [1, 2, 3, 4])
    session.forward()
    held = cache_nbytes(session.cache)
    config = loaded.model.config
    layers, heads = config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert held == 2 * layers * heads * head_dim * 4 * next(loaded.model.parameters()).element_size()


def test_engine_queue_counts_calls_waiting_for_the_model_thread():
    import asyncio
    import threading

    release = threading.Event()

    class Engine:
        def block(self):
            release.wait(10)
            return "blocked"

        def quick(self, x):
            return x

    async def main():
        host = EngineHost("test engine")
        host.engine = Engine()
        first = asyncio.ensure_future(host.run(host.engine.block))
        await asyncio.sleep(0.05)
        assert host.depth == 0                               # running, not waiting
        waiting = [asyncio.ensure_future(host.run(host.engine.quick, i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert host.depth == 3
        waiting[0].cancel()                                  # cancelled before it started: no longer waiting
        await asyncio.sleep(0.05)
        assert host.depth == 2
        release.set()
        assert await first == "blocked"
        assert await asyncio.gather(*waiting[1:]) == [1, 2]
        assert host.depth == 0

    asyncio.run(main())


def test_batched_verify_calls_each_keep_their_trace(observed):
    """Concurrent sessions share verifier forward passes; each batch span links every Verify it served."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["hello world, hello", "the cat sat on the mat", "abc abc abc", "one two three one two"]
    with Client(observed["cluster"].address) as client:
        with ThreadPoolExecutor(len(prompts)) as pool:
            completions = list(pool.map(lambda p: client.generate(p, max_new_tokens=16, k=3), prompts))
    sessions = {c.session_id for c in completions}
    deadline = time.monotonic() + 30
    while True:
        spans = observed["collector"].spans()
        roots = {s["attributes"].get(telemetry.ATTR_SESSION): s for s in spans
                 if s["name"] == GENERATE and s["kind"] == "SERVER"}
        if sessions <= roots.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(0.5)   # the verifier's last batch spans may still be on their way
    spans = observed["collector"].spans()
    batches = [s for s in spans if s["name"] == "engine.verify_batch"]
    linked = defaultdict(list)
    for batch in batches:
        assert batch["parent_span_id"] is None                       # the batch loop runs under no caller's span
        assert batch["attributes"][telemetry.ATTR_BATCH_SIZE] == len(batch["links"]) >= 1
        for span_id in batch["links"]:
            linked[span_id].append(batch)
    batch_sizes = []
    for completion in completions:
        trace_id = roots[completion.session_id]["trace_id"]
        verifies = [s for s in spans if s["trace_id"] == trace_id and s["name"] == VERIFY and s["kind"] == "SERVER"]
        assert len(verifies) == completion.stats.steps
        for verify in verifies:
            (batch,) = linked[verify["span_id"]]                      # exactly one pass served each Verify
            batch_sizes.append(batch["attributes"][telemetry.ATTR_BATCH_SIZE])
    assert all(1 <= b <= len(prompts) for b in batch_sizes)
