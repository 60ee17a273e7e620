"""Context variables that carry the current request's identity into logs."""

from __future__ import annotations

from contextvars import ContextVar

#: Id of the request being handled ("" outside a request).
request_id_var: ContextVar[str] = ContextVar("servewell_request_id", default="")
#: Id of the API key the current request presented ("" without keys); never the key itself.
client_var: ContextVar[str] = ContextVar("servewell_client", default="")
#: Model the current request is for ("" when unknown).
model_var: ContextVar[str] = ContextVar("servewell_model", default="")

#: Stable code of the error the current request was answered with ("" until one is), for the
#: console's list of failed requests; set where the error response is built.
error_code_var: ContextVar[str] = ContextVar("servewell_error_code", default="")

#: Stage durations (seconds) of the current request, filled by the route, read by the middleware.
stages_var: ContextVar[dict[str, float] | None] = ContextVar("servewell_stages", default=None)
#: OpenTelemetry context holding the request's `http` span (None when tracing is off); the
#: scheduler parents `queue` spans on it and links the `batch` span to it.
request_trace_var: ContextVar[object | None] = ContextVar("servewell_request_trace", default=None)
