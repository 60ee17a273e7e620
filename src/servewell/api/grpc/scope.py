"""What the HTTP middleware does for a request, done for one gRPC call: request id, trace
context, timing, metrics, the slow/failed-request log, and servewell errors as gRPC statuses.

Status codes follow the HTTP ones: 4xx input errors are INVALID_ARGUMENT, 404 NOT_FOUND, 503
refusals UNAVAILABLE (a deadline that passed DEADLINE_EXCEEDED), 401 UNAUTHENTICATED, 403
PERMISSION_DENIED, 409 ABORTED, 413 and 429 RESOURCE_EXHAUSTED, a bug INTERNAL. The stable servewell
error code and the request id travel in the trailing metadata (`servewell-error-code`,
`x-request-id`), so a gRPC client can tell `overloaded` from `model_not_ready`, and a refusal worth
retrying carries `retry-after` (whole seconds, as HTTP's Retry-After).

The order of a call: key check (from the headers), then the request message (within the receive
deadline), then a call slot (`CallSlots`), then the handler: a call whose message never completes
holds no slot, and one without a valid key never gets its message read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from servewell.api.grpc.codec import metadata_value
from servewell.api.grpc.incoming import CallLimitReached, CallUnimplemented, IncomingMessage, ReceiveTimeout
from servewell.api.grpc.limits import CallSlots
from servewell.api.keys import InferenceAccess
from servewell.api.request_outcome import record_outcome
from servewell.api.state import LiveKnobs
from servewell.errors import ClientClosed, ServeError, Unavailable
from servewell.observability.context import (
    MAX_ROUTE_KEY_CHARS,
    BatchPlacement,
    client_var,
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
from servewell.observability.refusal_log import RefusalDigest
from servewell.observability.tracing import Tracing, begin_server_span

log = logging.getLogger("servewell.api")

T = TypeVar("T")
M = TypeVar("M")
#: The servicer context of one call (request and response types vary by method).
RpcContext = grpc.aio.ServicerContext[Any, Any]

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED, 415: grpc.StatusCode.INVALID_ARGUMENT,
    408: grpc.StatusCode.DEADLINE_EXCEEDED, 501: grpc.StatusCode.UNIMPLEMENTED,
    422: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: ServeError) -> grpc.StatusCode:
    """The gRPC status for a servewell error."""
    if error.code == "deadline_exceeded":
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


#: Refusals a client can cause at will: one log line per model, code and second, with a count.
_DIGESTED = frozenset((CallUnimplemented.code, CallLimitReached.code, ReceiveTimeout.code, ClientClosed.code))


def retry_after_value(retry_after_s: float) -> str:
    """A `retry-after` trailer value: whole seconds, at least 1 (as HTTP's Retry-After)."""
    return str(max(1, math.ceil(retry_after_s)))


def _failed(context: RpcContext, code: grpc.StatusCode, details: str) -> None:
    """End the call with status `code` and no reply (what the handler returns then is not sent).
    Not `context.abort`: the `AbortError` it raises stays on grpc's call state, and with it this
    frame and every frame up to the handler (the request, its call, its tensors), a reference cycle
    per failed call left to the cyclic collector, whose pauses a flood of refusals makes long."""
    context.set_code(code)
    context.set_details(details)


class RpcScope:
    """Runs gRPC handlers inside a request context, as the HTTP middleware does for routes."""

    def __init__(self, metrics: ServeMetrics | None, tracing: Tracing | None, access: InferenceAccess,
                 knobs: LiveKnobs, recent: RecentRequests | None = None, slots: CallSlots | None = None) -> None:
        self._metrics = metrics
        self._recent = recent
        self._tracing = tracing if tracing is not None and tracing.enabled else None
        self._access = access
        self._knobs = knobs
        self._slots = slots if slots is not None else CallSlots(1024)
        # 503s and the refusals a client causes at will: one line per model, code and second, with a count
        self._refusals = RefusalDigest(log)

    @property
    def access(self) -> InferenceAccess:
        """The API keys in force (the admin calls' access rule reads them: api/access.py)."""
        return self._access

    async def unimplemented(self, context: RpcContext) -> None:
        """Answer a call servewell does not serve: UNIMPLEMENTED after the key check, logged only in
        the refusal digest (its method name, chosen by the client, goes into no log or label)."""
        async def refuse(request: None) -> None:
            raise CallUnimplemented("this server does not implement the method")
        await self.run("unimplemented", context, None, refuse)

    async def run(self, method: str, context: RpcContext, incoming: IncomingMessage[M] | None,
                  handler: Callable[[M], Awaitable[T]], probe: bool = False, admin: bool = False) -> T:
        """Run `handler` on the request message of the RPC `method`. Probes are neither timed nor
        traced as roots and take no call slot; every call but probes and admin calls (which check the
        admin token) needs an API key when keys are configured, checked before the message is read."""
        started = time.perf_counter()
        metadata = context.invocation_metadata()
        given = metadata_value(metadata, "x-request-id")
        request_id = given if given is not None and _SAFE_ID.match(given) else new_request_id()
        tokens = (request_id_var.set(request_id), model_var.set(""), stages_var.set({}),
                  placement_var.set(BatchPlacement()),
                  route_key_var.set((metadata_value(metadata, "x-route-key") or "")[:MAX_ROUTE_KEY_CHARS]))
        span = otel_token = trace_token = None
        if self._tracing is not None:
            span, span_context = begin_server_span(
                self._tracing, "grpc", metadata_value(metadata, "traceparent"), metadata_value(metadata, "tracestate"),
                not probe, {"rpc.system": "grpc", "rpc.method": method, "servewell.request_id": request_id},
            )
            if span_context is not None:
                otel_token = otel_context.attach(span_context)
                trace_token = request_trace_var.set(span_context)
        status, code = 200, ""
        context.set_trailing_metadata((("x-request-id", request_id),))
        client_token = None
        received = incoming is None
        try:
            if not probe and not admin and self._access.enabled:
                client = self._access.check(metadata_value(metadata, "authorization"),
                                            metadata_value(metadata, "x-api-key"))
                client_token = client_var.set(client or "")
            request: Any = await incoming.receive() if incoming is not None else None
            received = True
            if probe:
                return await handler(request)
            if not self._slots.try_take():
                raise CallLimitReached(f"{self._slots.limit} calls are in progress (grpc_max_concurrent_rpcs); "
                                       "retry later", retry_after_s=1.0)
            try:
                return await handler(request)
            finally:
                self._slots.give_back()
        except ServeError as exc:
            status, code = exc.status, exc.code
            if isinstance(exc, Unavailable) or exc.code in _DIGESTED:
                self._refusals.refused(model_var.get(), exc.code, exc.status, exc.message, exc.tenant)
            else:
                level = logging.WARNING if exc.status >= 500 else logging.INFO
                log.log(level, "request failed: %s", exc.message, extra={"status": exc.status, "code": exc.code})
            trailers = [("x-request-id", request_id), ("servewell-error-code", exc.code)]
            if exc.model_version:  # the version a traffic split drew, as a success's trailer says
                trailers.append(("x-model-version", exc.model_version))
            if exc.retry_after_s is not None:
                trailers.append(("retry-after", retry_after_value(exc.retry_after_s)))
            context.set_trailing_metadata(tuple(trailers))
            _failed(context, status_code(exc), exc.message)
            return cast(T, None)  # not sent: the call ends with the status
        except asyncio.CancelledError:
            status, code = 499, "cancelled"  # the client cancelled or its deadline passed: not a server error
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            status, code = 500, "internal"
            log.exception("unhandled error while serving gRPC %s", method)
            _failed(context, grpc.StatusCode.INTERNAL, f"internal server error; request id {request_id}")
            return cast(T, None)
        finally:
            elapsed = time.perf_counter() - started
            self._finish(method, status, code, elapsed, span, probe, received)
            if client_token is not None:
                client_var.reset(client_token)
            if trace_token is not None:
                request_trace_var.reset(trace_token)
            if otel_token is not None:
                otel_context.detach(otel_token)
            request_id_var.reset(tokens[0])
            model_var.reset(tokens[1])
            stages_var.reset(tokens[2])
            placement_var.reset(tokens[3])
            route_key_var.reset(tokens[4])

    def _finish(self, method: str, status: int, code: str, elapsed: float, span: trace.Span | None,
                probe: bool, received: bool) -> None:
        # A call whose message never arrived is counted, but is neither a slow request nor one the
        # console keeps: a slowloris would flood both (1,200 warnings when its connections closed).
        record_outcome(protocol="grpc", route=f"grpc {method}", status=status, error_code=code, elapsed_s=elapsed,
                       span=span, span_attributes={"rpc.grpc.servewell_status": status}, counted=not probe,
                       metrics=self._metrics, slow_after_s=self._knobs.slow_request_s if received else math.inf,
                       recent=self._recent if received else None)
