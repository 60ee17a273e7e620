"""Logging setup: JSON lines (default) or console lines, each carrying request id and model.

Request bodies, images and tensors are never passed to a logger anywhere in servewell.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys

import orjson
from opentelemetry import trace

from servewell.observability.context import client_var, model_var, placement_var, request_id_var

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, logger, message, request id, model, client, the
    request's batch facts (`batch_id`, `batch_size`, `instance`, `queue_position`, once known),
    trace ids, extras."""

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, object] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id:
            event["request_id"] = request_id
        model = getattr(record, "model", None) or model_var.get()
        if model:
            event["model"] = model
        client = client_var.get()
        if client:
            event["client"] = client
        placement = placement_var.get()
        if placement is not None:  # a line about a request that ran in a batch names the batch
            event.update(placement.facts())
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            event["trace_id"] = f"{span_context.trace_id:032x}"
            event["span_id"] = f"{span_context.span_id:016x}"
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in event and not key.startswith("_"):
                event[key] = value
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(event, default=str).decode()


class ConsoleFormatter(logging.Formatter):
    """Human-readable lines for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.name}: {record.getMessage()}"
        request_id = request_id_var.get()
        if request_id:
            line += f" [{request_id}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Route servewell's and uvicorn's logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter() if fmt == "json" else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The OTLP exporter logs every failed export; a down collector must not flood the log.
    logging.getLogger("opentelemetry").setLevel(logging.ERROR)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # One access line per request would be a per-request INFO log on the hot path.
    logging.getLogger("uvicorn.access").disabled = True
    # Python warnings (a framework's deprecation notice in a worker) become log lines in the same
    # format instead of plain text in the middle of the JSON lines.
    logging.captureWarnings(True)
