"""Logging for every service: plain text for people, JSON lines for log pipelines.

SPECMESH_LOG_FORMAT=json switches to one JSON object per line. Prompts and
outputs are never logged at INFO. Records carry the session id where the
orchestrator works on a session (`bind_session`) and the trace and span ids
while a span is active (tracing on, see specmesh.telemetry).
"""
from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

from opentelemetry import trace

# The session the current task works on (one Generate stream is one task).
SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("specmesh_session_id", default=None)


def bind_session(session_id: str | None) -> None:
    """Tag every record logged from this task (and tasks it starts) with the session id."""
    SESSION_ID.set(session_id)


class CorrelationFilter(logging.Filter):
    """Adds session_id (when bound) and trace_id / span_id (when a span is active) to records."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "session_id", None):
            session_id = SESSION_ID.get()
            if session_id:
                record.session_id = session_id
        if not getattr(record, "trace_id", None):
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                record.trace_id = trace.format_trace_id(ctx.trace_id)
                record.span_id = trace.format_span_id(ctx.span_id)
        return True


class TextFormatter(logging.Formatter):
    """The human format, with the session and trace ids appended when a record has them."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        ids = " ".join(f"{key}={value}" for key in ("session_id", "trace_id", "span_id")
                       if (value := getattr(record, key, None)))
        return f"{line} [{ids}]" if ids else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        for key in ("service", "session_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(service: str, level: str | None = None, fmt: str | None = None) -> None:
    fmt = (fmt or os.environ.get("SPECMESH_LOG_FORMAT", "text")).lower()
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    handler.addFilter(CorrelationFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("SPECMESH_LOG_LEVEL", "INFO")).upper())
    # Keep third-party chatter out of the service logs.
    for noisy in ("httpx", "urllib3", "filelock", "transformers", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.service = service
        return record

    logging.setLogRecordFactory(factory)
