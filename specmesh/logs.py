"""Logging for every service: plain text for people, JSON lines for log pipelines.

SPECMESH_LOG_FORMAT=json switches to one JSON object per line. Prompts and
outputs are never logged at INFO.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time


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
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
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
