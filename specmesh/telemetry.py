"""Traces and metrics for every tier: the one place their names are defined.

Tracing is off unless the standard variables ask for an exporter
(`OTEL_TRACES_EXPORTER=otlp|console|...`, or an `OTEL_EXPORTER_OTLP_*ENDPOINT`,
which implies otlp); then the OpenTelemetry SDK is installed and reads the rest
of its `OTEL_*` variables itself (service name and resource, sampler, batch
processor, exporter endpoints). Off, nothing is installed: the API's no-op
tracer answers every span and no gRPC interceptor is added.

Metrics (METRICS, a table) are OpenTelemetry instruments read by a Prometheus
endpoint on a service's `metrics_port`; without one, recording does nothing.
Counter names carry no `_total` here: the Prometheus exporter adds it.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from opentelemetry import metrics, trace

log = logging.getLogger("specmesh.telemetry")

# Spans made here; gRPC's are named by the instrumentation, the model thread's "engine.<method>".
SPAN_STEP, SPAN_ACCEPT, SPAN_COMMIT = "step", "accept", "commit"

# Span attributes.
ATTR_SESSION = "specmesh.session_id"
ATTR_STEP = "specmesh.step"
ATTR_K = "specmesh.k"
ATTR_DRAFT_TOKENS = "specmesh.draft_tokens"
ATTR_ACCEPTED_TOKENS = "specmesh.accepted_tokens"
ATTR_BONUS = "specmesh.bonus"
ATTR_COMMITTED_TOKENS = "specmesh.committed_tokens"
ATTR_QUEUE_WAIT = "specmesh.queue_wait_s"
ATTR_BATCH_SIZE = "specmesh.batch_size"

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_E2E = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0)
# key: (kind, Prometheus name, unit, description, histogram buckets). Names follow vLLM's where one exists.
METRICS = {
    "num_drafts": ("counter", "specmesh_spec_decode_num_drafts", "", "Steps that proposed at least one draft token.", None),
    "num_draft_tokens": ("counter", "specmesh_spec_decode_num_draft_tokens", "", "Draft tokens sent to verification.", None),
    "num_accepted_tokens": ("counter", "specmesh_spec_decode_num_accepted_tokens", "", "Draft tokens accepted.", None),
    "num_accepted_tokens_per_pos": ("counter", "specmesh_spec_decode_num_accepted_tokens_per_pos", "",
                                    "Accepted draft tokens by position in the draft (0 = first).", None),
    "num_recovered_tokens": ("counter", "specmesh_spec_decode_num_recovered_tokens", "",
                             "Recovered tokens committed: steps that ended on a rejected draft token.", None),
    "num_bonus_tokens": ("counter", "specmesh_spec_decode_num_bonus_tokens", "",
                         "Bonus tokens committed: steps whose draft tokens all passed (or had none).", None),
    "steps": ("counter", "specmesh_steps", "", "Decode steps (one Verify each), with or without draft tokens.", None),
    "committed_tokens": ("counter", "specmesh_committed_tokens", "", "Committed tokens streamed to clients.", None),
    "prompt_tokens": ("counter", "specmesh_prompt_tokens", "", "Prompt tokens of started requests.", None),
    "request_success": ("counter", "specmesh_request_success", "",
                        "Requests that finished, by finish reason (stop, length, cancelled).", None),
    "ttft": ("histogram", "specmesh_time_to_first_token_seconds", "s", "Request start to first committed token.", _LATENCY),
    "tpot": ("histogram", "specmesh_time_per_output_token_seconds", "s",
             "Per request: time after the first token over the tokens after the first.", _LATENCY),
    "e2e": ("histogram", "specmesh_e2e_request_latency_seconds", "s", "Request start to its last token.", _E2E),
    "step_duration": ("histogram", "specmesh_step_duration_seconds", "s",
                      "One decode step: Propose + Verify + accept + commit.", _LATENCY),
    # The name the Helm chart's orchestrator HPA custom metric defaults to.
    "active_streams": ("updown", "specmesh_orchestrator_active_sessions", "", "Generate streams being decoded.", None),
    "rpc_requests": ("counter", "specmesh_rpc_requests", "", "Finished gRPC calls served, by method and code.", None),
    "rpc_errors": ("counter", "specmesh_rpc_errors", "", "gRPC calls served that ended other than OK.", None),
    "engine_call_duration": ("histogram", "specmesh_engine_call_duration_seconds", "s",
                             "Time a call runs on the model thread.", _LATENCY),
    "engine_queue_wait": ("histogram", "specmesh_engine_queue_wait_seconds", "s",
                          "Time a call waits for the model thread.", _LATENCY),
    "verify_batch_size": ("histogram", "specmesh_verify_batch_size", "",
                          "Sessions whose Verify calls shared one target forward pass.", (1, 2, 4, 8, 16, 32, 64)),
}

_tier = ""
_tracer_provider = None
_meter_provider = None
_instruments: dict | None = None


def tracing_enabled() -> bool:
    return _tracer_provider is not None


def metrics_enabled() -> bool:
    return _meter_provider is not None


def tracer() -> trace.Tracer:
    return trace.get_tracer("specmesh")   # the API's no-op tracer unless tracing is set up


def setup(tier: str, metrics_port: int | None = None, environ: Mapping[str, str] = os.environ,
          metrics_addr: str = "0.0.0.0") -> None:
    """Install what the environment and settings ask for, once per process (`specmesh serve <tier>`)."""
    global _tier
    _tier = tier
    if trace_exporters(environ):
        setup_tracing(tier, environ)
    if metrics_port:
        setup_metrics(tier, metrics_port, metrics_addr)


def _resource(tier: str, environ: Mapping[str, str]):
    from opentelemetry.sdk.resources import Resource

    # Resource.create adds OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES over these.
    return Resource.create({"specmesh.tier": tier, "service.name": f"specmesh-{tier}"}
                           if not environ.get("OTEL_SERVICE_NAME") else {"specmesh.tier": tier})


def trace_exporters(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the environment asks for: [] leaves tracing off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return [] if "none" in names else list(dict.fromkeys(names))


def setup_tracing(tier: str, environ: Mapping[str, str] = os.environ):
    """An SDK tracer provider with the exporters named in OTEL_TRACES_EXPORTER, found the way the SDK
    finds them (the `opentelemetry_traces_exporter` entry points: otlp, console, any installed one)."""
    global _tracer_provider
    if _tracer_provider is not None:
        return _tracer_provider
    from importlib.metadata import entry_points

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource(tier, environ))   # the sampler comes from OTEL_TRACES_SAMPLER
    installed = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    # "otlp" means the OTLP exporter for OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, grpc by default.
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    otlp = "otlp_proto_http" if protocol.startswith("http") else "otlp_proto_grpc"
    for name in (otlp if n == "otlp" else n for n in trace_exporters(environ)):
        if name not in installed:
            log.warning("OTEL_TRACES_EXPORTER %r is not installed (installed: %s)", name, ", ".join(sorted(installed)))
            continue
        provider.add_span_processor(BatchSpanProcessor(installed[name].load()()))
    trace.set_tracer_provider(provider)
    _tracer_provider = provider
    log.info("tracing on (exporters: %s)", ", ".join(trace_exporters(environ)))
    return provider


def _grpc_filter():  # health checks and reflection stay out of traces (probes would drown everything)
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(filters.service_prefix("grpc.health."),
                                         filters.service_prefix("grpc.reflection.")))


def server_interceptors() -> list:
    """The OpenTelemetry aio server interceptor when tracing is on; [] when off."""
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_tracer_provider, filter_=_grpc_filter())]


def client_interceptors() -> list:
    """The OpenTelemetry aio client interceptors (context goes out in metadata) when tracing is on."""
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(tracer_provider=_tracer_provider, filter_=_grpc_filter())


def bind_session(session_id: str) -> None:
    """Name the session on the current span (the Generate server span) and in this task's log records."""
    from specmesh import logs

    logs.bind_session(session_id)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(ATTR_SESSION, session_id)


# ---------------------------------------------------------------- metrics


def setup_metrics(tier: str, port: int, addr: str = "0.0.0.0"):
    """A meter provider read by a Prometheus endpoint on `port` (/metrics)."""
    global _meter_provider
    if _meter_provider is not None:
        return _meter_provider
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import start_http_server

    _meter_provider = MeterProvider(metric_readers=[PrometheusMetricReader(scope_info_enabled=False)],
                                    resource=_resource(tier, os.environ))
    metrics.set_meter_provider(_meter_provider)
    start_http_server(port, addr=addr)
    log.info("metrics at http://%s:%d/metrics", addr, port)
    return _meter_provider


def _instrument(key: str):
    global _instruments
    if _instruments is None:
        meter, made = metrics.get_meter("specmesh"), {}
        for name, (kind, metric, unit, description, buckets) in METRICS.items():
            if kind == "histogram":
                made[name] = meter.create_histogram(metric, unit=unit, description=description,
                                                    explicit_bucket_boundaries_advisory=buckets)
            else:
                create = meter.create_counter if kind == "counter" else meter.create_up_down_counter
                made[name] = create(metric, unit=unit, description=description)
        _instruments = made
    return _instruments[key]


def record(key: str, value: float, attributes: Mapping[str, str]) -> None:
    """Add to a counter or record into a histogram of METRICS; nothing when metrics are off."""
    if _meter_provider is None:
        return
    instrument = _instrument(key)
    (instrument.record if METRICS[key][0] == "histogram" else instrument.add)(value, attributes)


def record_rpc_status(method: str, code) -> None:  # the StatusInterceptor's hook, once per finished call
    attrs = {"method": method, "code": code.name, "tier": _tier}
    record("rpc_requests", 1, attrs)
    if code.name != "OK":
        record("rpc_errors", 1, attrs)


def record_step(drafter: str, draft_tokens: int, accepted_tokens: int, bonus: bool, committed_tokens: int,
                seconds: float, first_token_s: float | None) -> None:
    """One decode step, as the orchestrator saw it; `first_token_s`: TTFT when this step made the first token."""
    if _meter_provider is None:
        return
    attrs = {"drafter": drafter}
    record("steps", 1, attrs)
    record("step_duration", seconds, attrs)
    record("num_bonus_tokens" if bonus else "num_recovered_tokens", 1, attrs)
    if draft_tokens:
        record("num_drafts", 1, attrs)
        record("num_draft_tokens", draft_tokens, attrs)
        record("num_accepted_tokens", accepted_tokens, attrs)
        for position in range(accepted_tokens):
            record("num_accepted_tokens_per_pos", 1, {"drafter": drafter, "position": str(position)})
    if committed_tokens:
        record("committed_tokens", committed_tokens, attrs)
    if first_token_s is not None:
        record("ttft", first_token_s, attrs)


def record_request(drafter: str, prompt_tokens: int) -> None:  # a Generate stream starts
    record("active_streams", 1, {"tier": _tier})
    record("prompt_tokens", prompt_tokens, {"drafter": drafter})


def record_request_end(drafter: str, finish_reason: str, elapsed_s: float, ttft_s: float | None,
                       committed_tokens: int) -> None:
    """The end of a Generate stream; `finish_reason` "" means it ended early (error, client gone)."""
    record("active_streams", -1, {"tier": _tier})
    if not finish_reason:
        return
    attrs = {"drafter": drafter}
    record("request_success", 1, {"drafter": drafter, "finished_reason": finish_reason})
    record("e2e", elapsed_s, attrs)
    if ttft_s is not None and committed_tokens > 1:
        record("tpot", (elapsed_s - ttft_s) / (committed_tokens - 1), attrs)


def observe_engine(tier: str, host) -> None:
    """Gauges over an EngineHost: queue depth, cached sessions, KV-cache bytes, evictions.

    The queue-depth names (specmesh_draft_queue_depth, specmesh_verifier_queue_depth)
    are what the Helm chart's HPA custom metrics default to.
    """
    if _meter_provider is None:
        return
    from specmesh.kv import cache_bytes

    meter, attrs = metrics.get_meter("specmesh"), {"tier": tier}

    def gauge(value_of):
        def callback(options):
            cache = getattr(host.engine, "sessions", None)
            yield metrics.Observation(value_of(cache) if cache is not None else 0, attrs)
        return [callback]

    meter.create_observable_gauge(f"specmesh_{tier}_queue_depth", callbacks=[
        lambda options: [metrics.Observation(host.waiting, attrs)]], description="Calls waiting for the model thread.")
    meter.create_observable_gauge("specmesh_cached_sessions", callbacks=gauge(len),
                                  description="Sessions whose state (KV cache, token history) this replica holds.")
    meter.create_observable_gauge("specmesh_kv_cache_bytes", unit="By", callbacks=gauge(cache_bytes),
                                  description="Bytes of KV-cache tensors held for cached sessions.")
    meter.create_observable_counter("specmesh_session_evictions", callbacks=gauge(lambda c: c.evictions),
                                    description="Sessions dropped by LRU or idle expiry (their next call re-prefills).")
