"""Traces and metrics for every tier: the one place their names are defined.

Tracing is off unless asked for, and then nothing is installed: no SDK tracer
provider (the OpenTelemetry API's no-op tracer answers every span) and no gRPC
interceptors. It is switched on by the standard variables:

    OTEL_TRACES_EXPORTER=otlp|console (comma-separated; "none" turns it off)
    OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (implies otlp)
    OTEL_SERVICE_NAME (default specmesh-<tier>), OTEL_RESOURCE_ATTRIBUTES,
    OTEL_TRACES_SAMPLER(_ARG), OTEL_SDK_DISABLED=true

and SPECMESH_TRACE_FILE=/path/spans-{tier}.jsonl, which writes one JSON span
per line (`{tier}` and `{pid}` are filled in), for tests and quick looks.

Metrics are OpenTelemetry instruments read by a Prometheus scrape endpoint
that each service starts on its `metrics_port` (SPECMESH_METRICS_PORT) when one
is set. Without one no meter provider is installed and every instrument below
is the API's no-op proxy. Counter names have no `_total` here: the Prometheus
exporter adds it (specmesh_steps -> specmesh_steps_total).
"""
from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace

log = logging.getLogger("specmesh.telemetry")

# ---------------------------------------------------------------- names

TRACER_NAME = "specmesh"
METER_NAME = "specmesh"

# Spans made here (the gRPC ones are named by the instrumentation: "/specmesh.v1.Draft/Propose", ...).
SPAN_STEP = "step"
SPAN_ACCEPT = "accept"
SPAN_COMMIT = "commit"
SPAN_ENGINE = "engine.{method}"   # the model-thread part of a draft / verifier call

# Span attributes.
ATTR_SESSION = "specmesh.session_id"
ATTR_STEP = "specmesh.step"
ATTR_DRAFT_TOKENS = "specmesh.draft_tokens"
ATTR_ACCEPTED_TOKENS = "specmesh.accepted_tokens"
ATTR_BONUS = "specmesh.bonus"
ATTR_NEW_TOKENS = "specmesh.new_tokens"
ATTR_K = "specmesh.k"
ATTR_QUEUE_WAIT = "specmesh.queue_wait_s"
ATTR_BATCH_SIZE = "specmesh.batch_size"

# Metric names as instruments see them; Prometheus shows counters with `_total`.
SPEC_DECODE_NUM_DRAFTS = "specmesh_spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "specmesh_spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "specmesh_spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "specmesh_spec_decode_num_accepted_tokens_per_pos"
STEPS = "specmesh_steps"
GENERATED_TOKENS = "specmesh_generated_tokens"
PROMPT_TOKENS = "specmesh_prompt_tokens"
REQUEST_SUCCESS = "specmesh_request_success"
TIME_TO_FIRST_TOKEN = "specmesh_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "specmesh_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "specmesh_e2e_request_latency_seconds"
STEP_DURATION = "specmesh_step_duration_seconds"
# These two names are what the Helm chart's HPA custom metrics default to.
ACTIVE_STREAMS = "specmesh_orchestrator_active_sessions"
RPC_REQUESTS = "specmesh_rpc_requests"
RPC_ERRORS = "specmesh_rpc_errors"
ENGINE_QUEUE_DEPTH = "specmesh_{tier}_queue_depth"   # specmesh_draft_queue_depth, specmesh_verifier_queue_depth
ENGINE_CALL_DURATION = "specmesh_engine_call_duration_seconds"
ENGINE_QUEUE_WAIT = "specmesh_engine_queue_wait_seconds"
CACHED_SESSIONS = "specmesh_cached_sessions"
KV_CACHE_BYTES = "specmesh_kv_cache_bytes"
SESSION_EVICTIONS = "specmesh_session_evictions"
VERIFY_BATCH_SIZE = "specmesh_verify_batch_size"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)

# ---------------------------------------------------------------- state

_lock = threading.Lock()
_tier = ""
_tracer_provider = None        # the SDK provider when tracing is on
_meter_provider = None         # the SDK provider when metrics are on
_metrics_port: int | None = None
_tracer: trace.Tracer | None = None


def tier() -> str:
    return _tier


def tracing_enabled() -> bool:
    return _tracer_provider is not None


def metrics_enabled() -> bool:
    return _meter_provider is not None


def tracer() -> trace.Tracer:
    """specmesh's tracer: a proxy that is the no-op tracer until (unless) tracing is set up."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


def setup(tier_name: str, metrics_port: int | None = None, environ: Mapping[str, str] = os.environ) -> None:
    """Install what the environment asks for, once per process (`specmesh serve <tier>`)."""
    global _tier
    _tier = tier_name
    setup_tracing(tier_name, environ)
    if metrics_port:
        setup_metrics(tier_name, metrics_port)


def shutdown() -> None:
    """Flush spans still buffered (the SDK also does this at exit)."""
    if _tracer_provider is not None:
        _tracer_provider.shutdown()
    if _meter_provider is not None:
        _meter_provider.shutdown()


def _resource(tier_name: str, environ: Mapping[str, str]):
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    attributes = {"specmesh.tier": tier_name}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = f"specmesh-{tier_name}"
    return Resource.create(attributes)


# ---------------------------------------------------------------- tracing


def trace_exporters(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters the environment asks for: [] means tracing stays off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if "none" in names:
        names = []
    elif not names and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    if environ.get("SPECMESH_TRACE_FILE"):
        names.append("file")
    return list(dict.fromkeys(names))


def setup_tracing(tier_name: str, environ: Mapping[str, str] = os.environ):
    """Install an SDK tracer provider when the environment asks for an exporter; else nothing."""
    global _tracer_provider
    exporters = trace_exporters(environ)
    if not exporters:
        return None
    with _lock:
        if _tracer_provider is not None:
            return _tracer_provider
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        provider = TracerProvider(resource=_resource(tier_name, environ))
        for name in exporters:
            if name == "otlp":
                protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                if protocol and protocol != "grpc":
                    log.warning("OTLP protocol %r is not installed; exporting spans over OTLP/gRPC", protocol)
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            elif name == "console":
                provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            elif name == "file":
                path = environ["SPECMESH_TRACE_FILE"].format(tier=tier_name, pid=os.getpid())
                provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
            else:
                log.warning("unknown OTEL_TRACES_EXPORTER %r ignored (supported: otlp, console, none)", name)
        trace.set_tracer_provider(provider)
        _tracer_provider = provider
    log.info("tracing on (exporters: %s)", ", ".join(exporters))
    return provider


def _grpc_filter():
    """Leave health checks and reflection out of traces (probes would drown everything)."""
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


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the active span, or None."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return trace.format_trace_id(ctx.trace_id), trace.format_span_id(ctx.span_id)


class JsonLinesSpanExporter:
    """Writes each finished span as one JSON object per line (append mode).

    Lines: name, kind, trace_id, span_id, parent_span_id, service, tier,
    start_ns, end_ns, status, attributes, events. Several processes may share a
    file: each line is one write() on an O_APPEND descriptor.
    """

    def __init__(self, path: str):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._ok, self._failure = SpanExportResult.SUCCESS, SpanExportResult.FAILURE
        self.path = path
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    @staticmethod
    def to_dict(span) -> dict:
        ctx, parent = span.context, span.parent
        resource = span.resource.attributes if span.resource else {}
        return {
            "name": span.name,
            "kind": span.kind.name,
            "trace_id": trace.format_trace_id(ctx.trace_id),
            "span_id": trace.format_span_id(ctx.span_id),
            "parent_span_id": trace.format_span_id(parent.span_id) if parent is not None else None,
            "service": resource.get("service.name"),
            "tier": resource.get("specmesh.tier"),
            "start_ns": span.start_time,
            "end_ns": span.end_time,
            "status": span.status.status_code.name,
            "status_description": span.status.description,
            "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
            "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
        }

    def export(self, spans):
        data = b"".join((json.dumps(self.to_dict(s), default=str) + "\n").encode() for s in spans)
        try:
            with self._lock:
                os.write(self._fd, data)
        except OSError:
            return self._failure
        return self._ok

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Every span in JsonLinesSpanExporter files (for tests and tools)."""
    spans = []
    for path in paths:
        try:
            with open(path) as f:
                spans += [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            continue
    return spans


# ---------------------------------------------------------------- metrics


def setup_metrics(tier_name: str, port: int, addr: str = "0.0.0.0"):
    """Install a meter provider read by a Prometheus endpoint on `port` (/metrics)."""
    global _meter_provider, _metrics_port
    with _lock:
        if _meter_provider is not None:
            return _meter_provider
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import start_http_server

        reader = PrometheusMetricReader(scope_info_enabled=False)
        provider = MeterProvider(metric_readers=[reader], resource=_resource(tier_name, os.environ))
        metrics.set_meter_provider(provider)
        start_http_server(port, addr=addr)
        _meter_provider, _metrics_port = provider, port
    log.info("metrics at http://%s:%d/metrics", addr, port)
    return provider


class _Instruments:
    """Every instrument, made once from the global meter. Before (or without)
    setup_metrics these are the API's proxies: recording on them does nothing."""

    def __init__(self):
        m = metrics.get_meter(METER_NAME)
        self.num_drafts = m.create_counter(
            SPEC_DECODE_NUM_DRAFTS, description="Steps that proposed at least one draft token.")
        self.num_draft_tokens = m.create_counter(
            SPEC_DECODE_NUM_DRAFT_TOKENS, description="Draft tokens proposed and sent to verification.")
        self.num_accepted_tokens = m.create_counter(
            SPEC_DECODE_NUM_ACCEPTED_TOKENS, description="Draft tokens accepted by the verifier.")
        self.num_accepted_tokens_per_pos = m.create_counter(
            SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
            description="Accepted draft tokens by their position in the draft (0 = first drafted token).")
        self.steps = m.create_counter(STEPS, description="Decode steps (one Verify each), with or without drafts.")
        self.generated_tokens = m.create_counter(
            GENERATED_TOKENS, description="Tokens committed and streamed to clients.")
        self.prompt_tokens = m.create_counter(PROMPT_TOKENS, description="Prompt tokens of started requests.")
        self.request_success = m.create_counter(
            REQUEST_SUCCESS, description="Requests that finished, by finish reason (stop, length, cancelled).")
        self.ttft = m.create_histogram(
            TIME_TO_FIRST_TOKEN, unit="s", description="Time from request start to its first committed token.",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.tpot = m.create_histogram(
            TIME_PER_OUTPUT_TOKEN, unit="s",
            description="Per request: time after the first token divided by the tokens after the first.",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.e2e = m.create_histogram(
            E2E_REQUEST_LATENCY, unit="s", description="Time from request start to its last token.",
            explicit_bucket_boundaries_advisory=_E2E_BUCKETS)
        self.step_duration = m.create_histogram(
            STEP_DURATION, unit="s", description="One decode step: Propose + Verify + accept + commit.",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.active_streams = m.create_up_down_counter(
            ACTIVE_STREAMS, description="Generate streams being decoded by this orchestrator.")
        self.rpc_requests = m.create_counter(
            RPC_REQUESTS, description="Finished gRPC calls served, by method and status code.")
        self.rpc_errors = m.create_counter(
            RPC_ERRORS, description="gRPC calls served that ended with a status other than OK.")
        self.engine_call_duration = m.create_histogram(
            ENGINE_CALL_DURATION, unit="s", description="Time a call runs on the model thread.",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.engine_queue_wait = m.create_histogram(
            ENGINE_QUEUE_WAIT, unit="s", description="Time a call waits for the model thread.",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.verify_batch_size = m.create_histogram(
            VERIFY_BATCH_SIZE, description="Sessions whose Verify calls shared one target forward pass.",
            explicit_bucket_boundaries_advisory=(1, 2, 4, 8, 16, 32, 64))


_instruments: _Instruments | None = None


def instruments() -> _Instruments:
    global _instruments
    if _instruments is None:
        with _lock:
            if _instruments is None:
                _instruments = _Instruments()
    return _instruments


# Recording helpers: each call site is one line.


def record_rpc_status(method: str, code) -> None:
    """ServiceRuntime's StatusInterceptor hook: one call per finished call."""
    if _meter_provider is None:
        return
    attrs = {"method": method, "code": code.name, "tier": _tier}
    inst = instruments()
    inst.rpc_requests.add(1, attrs)
    if code.name != "OK":
        inst.rpc_errors.add(1, attrs)


def record_verify_batch(size: int) -> None:
    if _meter_provider is not None:
        instruments().verify_batch_size.record(size, {"tier": _tier})


def record_request_start(drafter: str, prompt_tokens: int) -> None:
    if _meter_provider is None:
        return
    inst = instruments()
    inst.active_streams.add(1, {"tier": _tier})
    inst.prompt_tokens.add(prompt_tokens, {"drafter": drafter})


def record_step(drafter: str, draft_tokens: int, accepted_tokens: int, new_tokens: int, seconds: float,
                first_token_s: float | None) -> None:
    """One decode step, as the orchestrator saw it. `first_token_s`: TTFT when this step made the first token."""
    if _meter_provider is None:
        return
    inst = instruments()
    attrs = {"drafter": drafter}
    inst.steps.add(1, attrs)
    inst.step_duration.record(seconds, attrs)
    if draft_tokens:
        inst.num_drafts.add(1, attrs)
        inst.num_draft_tokens.add(draft_tokens, attrs)
        inst.num_accepted_tokens.add(accepted_tokens, attrs)
        for position in range(accepted_tokens):
            inst.num_accepted_tokens_per_pos.add(1, {"drafter": drafter, "position": str(position)})
    if new_tokens:
        inst.generated_tokens.add(new_tokens, attrs)
    if first_token_s is not None:
        inst.ttft.record(first_token_s, attrs)


def record_request_end(drafter: str, finish_reason: str, elapsed_s: float, ttft_s: float | None,
                       generated_tokens: int) -> None:
    """The end of a Generate stream; `finish_reason` "" means it ended early (error, client gone)."""
    if _meter_provider is None:
        return
    inst = instruments()
    inst.active_streams.add(-1, {"tier": _tier})
    if not finish_reason:
        return
    attrs = {"drafter": drafter}
    inst.request_success.add(1, {"drafter": drafter, "finished_reason": finish_reason})
    inst.e2e.record(elapsed_s, attrs)
    if ttft_s is not None and generated_tokens > 1:
        inst.tpot.record((elapsed_s - ttft_s) / (generated_tokens - 1), attrs)


# ---------------------------------------------------------------- engines (draft and verifier)


class EngineQueue:
    """Counts the calls an EngineHost has handed to its model thread that have
    not started yet (the queue depth), and wraps each for the thread: it runs in
    the submitting task's context (so under the call's server span) inside an
    `engine.<method>` span, and its queue wait and run time are recorded."""

    def __init__(self):
        self._lock = threading.Lock()
        self.depth = 0
        # Calls queued in front of this queue (a batcher's), counted as waiting too.
        self.waiting_elsewhere: list[Callable[[], int]] = []

    @property
    def waiting(self) -> int:
        """What the queue-depth gauge shows: calls here not yet started, plus those queued elsewhere."""
        return self.depth + sum(count() for count in self.waiting_elsewhere)

    def submit(self, method: str, fn: Callable, *args, parents: "Sequence[Parent] | None" = None) -> "_EngineJob":
        """`parents`: for a job serving several queued calls at once (a batch), each call's
        trace context and arrival; each call then gets its own span over the shared run."""
        with self._lock:
            self.depth += 1
        return _EngineJob(self, method, fn, args, parents)

    def _leave(self, job: "_EngineJob") -> bool:
        with self._lock:
            if job.left:
                return False
            job.left = True
            self.depth -= 1
            return True


class Parent(NamedTuple):
    """A call queued on its way to the model thread (by a batcher): its trace context
    (None with tracing off) and when it arrived."""

    context: object | None
    submitted: float


def capture() -> Parent:
    """The current call as a Parent, to pass along with it through a queue."""
    return Parent(otel_context.get_current() if _tracer_provider is not None else None, time.perf_counter())


class _EngineJob:
    __slots__ = ("queue", "method", "fn", "args", "context", "submitted", "left", "parents")

    def __init__(self, queue: EngineQueue, method: str, fn: Callable, args: tuple,
                 parents: Sequence[Parent] | None = None):
        self.queue, self.method, self.fn, self.args, self.parents = queue, method, fn, args, parents
        self.context = contextvars.copy_context()
        self.submitted = time.perf_counter()
        self.left = False

    def __call__(self):
        """Runs on the model thread."""
        self.queue._leave(self)
        return self.context.run(self._run, time.perf_counter())

    def settle(self) -> None:
        """After the await, whatever happened: a call cancelled before it started leaves the queue."""
        self.queue._leave(self)

    def _run(self, started: float):
        if self.parents is not None:
            return self._run_for(self.parents, started)
        wait = started - self.submitted
        with tracer().start_as_current_span(SPAN_ENGINE.format(method=self.method)) as span:
            if span.is_recording():
                span.set_attribute(ATTR_QUEUE_WAIT, wait)
            try:
                return self.fn(*self.args)
            finally:
                if _meter_provider is not None:
                    inst = instruments()
                    attrs = {"tier": _tier, "method": self.method}
                    inst.engine_queue_wait.record(wait, attrs)
                    inst.engine_call_duration.record(time.perf_counter() - started, attrs)

    def _run_for(self, parents: Sequence[Parent], started: float):
        """One run serving several calls: each call's trace gets an `engine.<method>` span
        over it (same start and end, `specmesh.batch_size`), each call's wait is recorded."""
        start_ns, error = time.time_ns(), None
        try:
            return self.fn(*self.args)
        except BaseException as e:
            error = e
            raise
        finally:
            end_ns, ended = time.time_ns(), time.perf_counter()
            name = SPAN_ENGINE.format(method=self.method)
            for parent in parents:
                if parent.context is None:
                    continue
                span = tracer().start_span(name, context=parent.context, start_time=start_ns, attributes={
                    ATTR_QUEUE_WAIT: started - parent.submitted, ATTR_BATCH_SIZE: len(parents)})
                if error is not None:
                    span.record_exception(error)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
                span.end(end_time=end_ns)
            if _meter_provider is not None:
                inst = instruments()
                attrs = {"tier": _tier, "method": self.method}
                for parent in parents:
                    inst.engine_queue_wait.record(started - parent.submitted, attrs)
                inst.engine_call_duration.record(ended - started, attrs)


def tensor_bytes(tensor, seen: set | None = None) -> int:
    """Memory behind a tensor: its storage, counted once per `seen` set (a cropped cache
    tensor is a view of a larger one; a batched forward leaves sessions sharing one)."""
    if tensor is None:
        return 0
    try:
        storage = tensor.untyped_storage()
        if seen is not None:
            key = (storage.device.type, storage.data_ptr())
            if key in seen:
                return 0
            seen.add(key)
        return storage.nbytes()
    except (AttributeError, RuntimeError):
        return getattr(tensor, "nbytes", 0) or 0


def cache_nbytes(cache, seen: set | None = None) -> int:
    """Bytes held by a transformers cache's tensors (DynamicCache layers or the older key/value lists)."""
    if cache is None:
        return 0
    seen = set() if seen is None else seen
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in list(layers):
            total += tensor_bytes(getattr(layer, "keys", None), seen)
            total += tensor_bytes(getattr(layer, "values", None), seen)
        return total
    for name in ("key_cache", "value_cache"):
        for tensor in list(getattr(cache, name, ()) or ()):
            total += tensor_bytes(tensor, seen)
    return total


def _session_states(store) -> list:
    """A snapshot of a SessionStore's values, taken from another thread (retries a concurrent change)."""
    for _ in range(5):
        try:
            return list(store.values())
        except RuntimeError:   # the model thread changed the store mid-iteration
            continue
    return []


def _state_cache(state):
    """The KV cache object behind a session value (KVSession, or DraftSession.state)."""
    cache = getattr(state, "cache", None)
    if cache is None and hasattr(state, "state"):
        cache = getattr(state.state, "cache", None)
    return cache


def observe_engine(tier_name: str, host) -> None:
    """Gauges over an EngineHost: queue depth, cached sessions, KV-cache bytes, evictions."""
    if _meter_provider is None:
        return
    m = metrics.get_meter(METER_NAME)
    attrs = {"tier": tier_name}

    def sessions():
        engine = host.engine
        return getattr(engine, "sessions", None) if engine is not None else None

    def queue_depth(options):
        yield metrics.Observation(host.queue.waiting, attrs)

    def cached_sessions(options):
        store = sessions()
        yield metrics.Observation(len(store) if store is not None else 0, attrs)

    def kv_bytes(options):
        store = sessions()
        total, seen = 0, set()
        if store is not None:
            for state in _session_states(store):
                try:
                    total += cache_nbytes(_state_cache(state), seen)
                except Exception:  # noqa: BLE001 - a scrape must never fail on a racing cache
                    continue
        yield metrics.Observation(total, attrs)

    def evictions(options):
        store = sessions()
        yield metrics.Observation(getattr(store, "evictions", 0) if store is not None else 0, attrs)

    m.create_observable_gauge(ENGINE_QUEUE_DEPTH.format(tier=tier_name), callbacks=[queue_depth],
                              description="Calls waiting for the model thread.")
    m.create_observable_gauge(CACHED_SESSIONS, callbacks=[cached_sessions],
                              description="Sessions whose state (KV cache, token history) this replica holds.")
    m.create_observable_gauge(KV_CACHE_BYTES, callbacks=[kv_bytes], unit="By",
                              description="Bytes of KV-cache tensors held for cached sessions.")
    m.create_observable_counter(SESSION_EVICTIONS, callbacks=[evictions],
                                description="Sessions dropped by LRU or idle expiry (their next call re-prefills).")


def status_hook(on_status: Callable | None = None) -> Callable:
    """The StatusInterceptor hook: the RPC counters, then `on_status` if given."""
    if on_status is None:
        return record_rpc_status

    def both(method, code):
        record_rpc_status(method, code)
        on_status(method, code)

    return both


def bind_session(session_id: str) -> None:
    """Name the session on the current span (the Generate server span) and in this task's log records."""
    from specmesh import logs

    logs.bind_session(session_id)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(ATTR_SESSION, session_id)
