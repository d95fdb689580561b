"""Logging set-up shared by the three services: plain text (the default) or one JSON object per line
(`--log-format json`), for log pipelines (Loki, Elasticsearch, Cloud Logging).

Structured fields travel as `extra=` on a log call and become JSON keys (text format: key=value after
the message). The fields in use: session_id, request_id, round, proposer, k, drafts, accepted, code
(a gRPC status name), status (an HTTP status), finish_reason, and counts and timings. Prompt and
output text are never logged at INFO or above.

gRPC core (C++) logs past Python's logging, as plain text on stderr, and by default at INFO (a GOAWAY from
a replica that stopped with calls in flight, for one): that would break `--log-format json`'s one object
per line. So each service's entry point keeps it to errors (GRPC_VERBOSITY=ERROR, unless the user set it)
before gRPC loads: gRPC reads it once, when it starts, and a service imports gRPC before it parses flags.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FORMATS = ("text", "json")
# LogRecord attributes that are not `extra` fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "color_message"}


def extra_fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "service", "logger", "message", ...extra fields, "exception"?} on one line."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(extra_fields(record))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The classic line, with the extra fields appended as key=value."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = extra_fields(record)
        if fields:
            tail = " ".join(f"{k}={v}" for k, v in fields.items())
            head, nl, rest = line.partition("\n")  # keep a traceback below the fields
            line = f"{head} {tail}{nl}{rest}"
        return line


def configure_logging(service: str, level: str = "info", fmt: str = "text", stream=None) -> None:
    """Replace the root logger's handlers with one writing `fmt` to `stream` (stderr)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # uvicorn installs its own handlers unless told otherwise; route its records through ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
