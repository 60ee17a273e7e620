"""What every finished request leaves behind, whichever protocol it came by: its span closed with
the outcome, the request-duration sample, and, when it was slow or failed, one log line and a
record in the console's list of recent requests."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.trace import Span

from servewell.observability.context import model_var, request_id_var, stages_var
from servewell.observability.metrics import ServeMetrics
from servewell.observability.recent_requests import RecentRequests, RequestRecord

log = logging.getLogger("servewell.api")


def record_outcome(*, protocol: str, route: str, status: int, error_code: str, elapsed_s: float, span: Span | None,
                   span_attributes: dict[str, str | int], counted: bool, metrics: ServeMetrics | None,
                   slow_after_s: float, recent: RecentRequests | None) -> None:
    """Close `span` with `span_attributes` and the outcome; then, unless the request is plumbing
    (`counted` false: probes, scrapes, docs), record its duration, and log and keep it when it was
    slow or failed (failed ones were logged where their error was built)."""
    model = model_var.get()
    if span is not None:
        for key, value in span_attributes.items():
            span.set_attribute(key, value)
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
    if slow:
        log.warning("slow request: %.1f ms on %s (status %d)", elapsed_s * 1000, route, status,
                    extra={"route": route, "status": status, "total_ms": round(elapsed_s * 1000, 3),
                           "stages_ms": stages})
    if recent is not None:
        recent.record(RequestRecord(request_id_var.get(), protocol, route, model, status, error_code,
                                    round(elapsed_s * 1000, 3), slow, stages))
