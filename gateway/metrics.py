"""The gateway's Prometheus metrics, served on its own HTTP port at /metrics.

Same style as the other tiers (specmesh.telemetry): OpenTelemetry instruments
read by the Prometheus exporter, `specmesh_` names, `tier="gateway"`. Each app
has its own registry, so several apps in one process (tests) do not collide.
"""
from __future__ import annotations

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

REQUESTS = "specmesh_gateway_requests"               # by route and HTTP status
ACTIVE_STREAMS = "specmesh_gateway_active_streams"   # SSE responses open now (an HPA signal)
TIME_TO_FIRST_TOKEN = "specmesh_gateway_time_to_first_token_seconds"
REQUEST_DURATION = "specmesh_gateway_request_duration_seconds"
COMMITTED_TOKENS = "specmesh_gateway_committed_tokens"
DISCONNECTS = "specmesh_gateway_client_disconnects"  # streams the client closed early (session cancelled)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        self.provider = MeterProvider(metric_readers=[reader],
                                      resource=Resource.create({"service.name": "specmesh-gateway"}))
        m = self.provider.get_meter("specmesh.gateway")
        self.requests = m.create_counter(REQUESTS, description="HTTP requests answered, by route and status.")
        self.active = m.create_up_down_counter(ACTIVE_STREAMS, description="Streaming responses open now.")
        self.ttft = m.create_histogram(TIME_TO_FIRST_TOKEN, unit="s",
                                       description="Request arrival to the first text sent to the client.",
                                       explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.duration = m.create_histogram(REQUEST_DURATION, unit="s",
                                           description="Request arrival to the last byte of the response.",
                                           explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.committed = m.create_counter(COMMITTED_TOKENS, description="Committed tokens sent to clients.")
        self.disconnects = m.create_counter(DISCONNECTS, description="Streams closed by the client before the end.")

    def request(self, route: str, status: int) -> None:
        self.requests.add(1, {"route": route, "status": str(status), "tier": "gateway"})

    def scrape(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        self.provider.shutdown()
