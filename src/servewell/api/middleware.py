"""Pure ASGI middleware: request id, trace context, timing, metrics, slow/failed request logs,
and a JSON 500 for anything unexpected.

Pure ASGI (not BaseHTTPMiddleware) so it adds no task or body copy per request.
"""

from __future__ import annotations

import logging
import re
import time

from opentelemetry import context as otel_context
from opentelemetry.trace import Span
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servewell.api.errors import error_response
from servewell.api.request_outcome import record_outcome
from servewell.api.state import LiveKnobs
from servewell.errors import quote
from servewell.observability.context import (
    MAX_ROUTE_KEY_CHARS,
    BatchPlacement,
    client_var,
    error_code_var,
    model_var,
    new_request_id,
    placement_var,
    request_id_var,
    request_trace_var,
    route_key_var,
    stages_var,
)
from servewell.observability.metrics import ServeMetrics
from servewell.observability.recent_requests import RecentRequests
from servewell.observability.tracing import Tracing, begin_server_span

log = logging.getLogger("servewell.api")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# Probes, scrapes and docs: neither timed in the request histogram nor started as traces (a
# kubelet probe or a Prometheus scrape every few seconds would otherwise fill both with noise);
# a caller's sampled trace is still followed.
_PLUMBING = frozenset(("/metrics", "/healthz", "/v2/health/live", "/v2/health/ready", "/docs", "/openapi.json",
                       "/", "/console/api/state"))


class RequestContextMiddleware:
    """Assigns (or accepts a safe client-supplied) `X-Request-ID`, continues a W3C trace,
    times the request, and records it in metrics and (when slow or failed) in the log and in
    `recent` (the console's list)."""

    def __init__(self, app: ASGIApp, knobs: LiveKnobs, metrics: ServeMetrics | None = None,
                 tracing: Tracing | None = None, recent: RecentRequests | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.recent = recent
        self.tracing = tracing if tracing is not None and tracing.enabled else None
        self.knobs = knobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = traceparent = tracestate = None
        route_key = ""
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                candidate = value.decode("latin-1")
                request_id = candidate if _SAFE_ID.match(candidate) else None
            elif key == b"traceparent":
                traceparent = value.decode("latin-1")
            elif key == b"tracestate":
                tracestate = value.decode("latin-1")
            elif key == b"x-route-key":
                route_key = value[:MAX_ROUTE_KEY_CHARS].decode("latin-1")
        request_id = request_id or new_request_id()
        tokens = (request_id_var.set(request_id), model_var.set(""), stages_var.set({}),
                  placement_var.set(BatchPlacement()), client_var.set(""), route_key_var.set(route_key))
        span = otel_token = trace_token = None
        if self.tracing is not None:
            span, span_context = begin_server_span(
                self.tracing, "http", traceparent, tracestate, scope["path"] not in _PLUMBING,
                {"http.request.method": scope.get("method", ""), "url.path": scope.get("path", ""),
                 "servewell.request_id": request_id},
            )
            if span_context is not None:
                otel_token = otel_context.attach(span_context)
                trace_token = request_trace_var.set(span_context)
        status = 500
        response_started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal response_started, status
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                headers.append((b"x-process-time", f"{time.perf_counter() - started:.6f}".encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except ClientDisconnect:
            # The client went away (a route that did not turn it into `ClientClosed`): its choice,
            # not a server error, so no traceback and no 5xx sample.
            status = status if response_started else 499
            log.info("the client disconnected during %s %s", quote(scope.get("method")), quote(scope.get("path")))
        except Exception:
            log.exception("unhandled error while serving %s %s", quote(scope.get("method")), quote(scope.get("path")))
            if not response_started:
                response = error_response(500, "internal", "internal server error; the request id is in this body",
                                          path=scope.get("path", ""))
                await response(scope, receive, send_with_headers)
        finally:
            self._finish(scope, status, time.perf_counter() - started, span)
            if trace_token is not None:
                request_trace_var.reset(trace_token)
            if otel_token is not None:
                otel_context.detach(otel_token)
            request_id_var.reset(tokens[0])
            model_var.reset(tokens[1])
            stages_var.reset(tokens[2])
            placement_var.reset(tokens[3])
            client_var.reset(tokens[4])  # the key check sets it inside; the record in `_finish` names it
            route_key_var.reset(tokens[5])

    def _finish(self, scope: Scope, status: int, elapsed: float, span: Span | None) -> None:
        route = scope.get("route")
        template = getattr(route, "path", None) or "unmatched"
        record_outcome(protocol="http", route=template, status=status, error_code=error_code_var.get(),
                       elapsed_s=elapsed, span=span,
                       span_attributes={"http.route": template, "http.response.status_code": status},
                       # Every route is served in the process that accepted the request, so every request is
                       # recorded once, here; the engine sums every process's records into one view.
                       counted=template not in _PLUMBING, metrics=self.metrics,
                       slow_after_s=self.knobs.slow_request_s, recent=self.recent)
