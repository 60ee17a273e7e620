"""What every finished request leaves behind, whichever protocol it came by: its span closed with
the outcome (and, when it ran in a batch, `servewell.batch.id`, `servewell.batch.size`,
`servewell.worker.instance`, `servewell.queue.position`), the request-duration sample, and, when
it was slow or failed, a log line (rate-limited: `observability/slow_log.py`) and a record in the
console's lists (`observability/recent_requests.py`), both carrying the same batch facts."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.trace import Span

from servewell.observability.context import client_var, model_var, placement_var, request_id_var, stages_var
from servewell.observability.metrics import ServeMetrics
from servewell.observability.recent_requests import RecentRequests, RequestRecord
from servewell.observability.slow_log import record_fields

log = logging.getLogger("servewell.api")

#: Span attribute of each `BatchPlacement` fact.
SPAN_ATTRIBUTES = {"batch_id": "servewell.batch.id", "batch_size": "servewell.batch.size",
                   "instance": "servewell.worker.instance", "queue_position": "servewell.queue.position"}


def record_outcome(*, protocol: str, route: str, status: int, error_code: str, elapsed_s: float, span: Span | None,
                   span_attributes: dict[str, str | int], counted: bool, metrics: ServeMetrics | None,
                   slow_after_s: float, recent: RecentRequests | None) -> None:
    """Close `span` with `span_attributes`, the batch facts and the outcome; then, unless the
    request is plumbing (`counted` false: probes, scrapes, docs), record its duration, and log and
    keep it when it was slow or failed (failed ones were logged where their error was built)."""
    model = model_var.get()
    placement = placement_var.get()
    facts = placement.facts() if placement is not None else {}
    if span is not None:
        for key, value in span_attributes.items():
            span.set_attribute(key, value)
        for name, value in facts.items():
            span.set_attribute(SPAN_ATTRIBUTES[name], value)
        if model:
            span.set_attribute("servewell.model", model)
        if status >= 500:
            span.set_status(trace.StatusCode.ERROR)
        span.end()
    if not counted:
        return
    if metrics is not None:
        metrics.observe_request(model, route, status, elapsed_s)
    slow = elapsed_s > slow_after_s
    if not slow and status < 400:
        return
    stages = {k: round(v * 1000, 3) for k, v in (stages_var.get() or {}).items()}
    record = RequestRecord(request_id_var.get(), protocol, route, model, status, error_code,
                           round(elapsed_s * 1000, 3), slow, stages, batch_id=facts.get("batch_id"),
                           batch_size=facts.get("batch_size"), instance=facts.get("instance"),
                           queue_position=facts.get("queue_position"), client=client_var.get())
    if slow:
        if recent is not None:
            recent.slow_log.slow(record)
        else:
            log.warning("slow request: %.1f ms on %s (status %d)", record.total_ms, route, status,
                        extra=record_fields(record))
    if recent is not None:
        recent.record(record)
