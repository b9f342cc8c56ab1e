"""A minimal OTLP/gRPC trace collector for tests and tools: the services export to it
with the real OTLP exporter (OTEL_TRACES_EXPORTER=otlp), and the spans are read back."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self._spans: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("localhost:0")

    @property
    def endpoint(self) -> str:
        return f"http://localhost:{self.port}"

    def env(self) -> dict[str, str]:
        """What a service needs to export here, quickly."""
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "name": s.name, "kind": _KINDS[s.kind], "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex() or None, "service": resource.get("service.name"),
                        "tier": resource.get("specmesh.tier"), "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano, "status": _STATUS[s.status.code],
                        "attributes": _attributes(s.attributes),
                        "links": [link.span_id.hex() for link in s.links]})
        with self._lock:
            self._spans += spans
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[dict]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> "Collector":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(None)
