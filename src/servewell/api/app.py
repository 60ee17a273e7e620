"""Builds the FastAPI application from an `AppState`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

import servewell
from servewell.api import (
    routes_admin,
    routes_cache,
    routes_console,
    routes_docs,
    routes_metrics,
    routes_openai,
    routes_pool,
    routes_simple,
    routes_stream,
    routes_tenants,
    routes_v2,
)
from servewell.api.access import access_rule
from servewell.api.errors import install_error_handlers
from servewell.api.head_requests import HeadAsGetMiddleware
from servewell.api.hot_routes import HotRoute, HotRouteDispatcher, HotRouteTable
from servewell.api.key_middleware import ApiKeyMiddleware
from servewell.api.middleware import RequestContextMiddleware
from servewell.api.openapi import truthful_openapi
from servewell.api.state import AppState
from servewell.observability.metrics import ServeMetrics
from servewell.observability.tracing import Tracing

DESCRIPTION = """servewell serves ONNX, TorchScript and PyTorch models.

* `POST /predict`: one base64 image in, a label out.
* `/v2/...`: the Open Inference Protocol v2 (KServe / Triton REST), usable with `tritonclient`.
* Every response carries `X-Request-ID` and `X-Process-Time`; errors are
  `{"error": {"code", "message", "request_id"}}`, on `/v2/...` OIP's `{"error": "<message>",
  "code", "request_id"}`; both with the code in `X-Error-Code`.
"""


def create_app(
    state: AppState,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The HTTP application; `on_startup`/`on_shutdown` run in its lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    # /docs comes from the package (routes_docs.py), not FastAPI's CDN page; ReDoc is not served.
    app = ServewellApp(title="servewell", version=servewell.__version__, description=DESCRIPTION, lifespan=lifespan,
                       docs_url=None, redoc_url=None, telemetry=NO_FRAMEWORK_TELEMETRY)
    app.state.servewell = state
    answer_serve_error = install_error_handlers(app)
    app.include_router(routes_simple.router)
    app.include_router(routes_v2.router)
    app.include_router(routes_stream.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_admin.repository_router)
    app.include_router(routes_pool.router)
    app.include_router(routes_cache.router)
    app.include_router(routes_tenants.router)
    app.include_router(routes_metrics.router)
    app.include_router(routes_console.router)
    app.include_router(routes_docs.router)
    app.openapi = truthful_openapi(app)  # type: ignore[method-assign]
    # Innermost of ours: POST to an inference path runs its endpoint here, past FastAPI's own
    # middleware, routing and dependency solving (api/hot_routes.py); the routes stay registered
    # above for /openapi.json and for every request the dispatcher leaves to FastAPI.
    table = HotRouteTable([*routes_simple.hot_routes(), *routes_v2.hot_routes()])
    chain: ASGIApp = HotRouteDispatcher(app.framework, table=table, on_error=answer_serve_error,
                                        on_dispatch=_fast_path_counter(state.metrics))
    # HEAD is turned into GET inside the request context and the key check, so logs and metrics
    # still say HEAD.
    chain = HeadAsGetMiddleware(chain)
    # The request context (id, metrics, logs) wraps the key check.
    chain = ApiKeyMiddleware(chain, access=state.access, knobs=state.knobs,
                             rule=lambda: access_rule(state.settings, state.access))
    app.front = RequestContextMiddleware(chain, knobs=state.knobs, metrics=state.metrics, tracing=tracing,
                                         recent=state.console.recent)
    return app


#: FastAPI's native OpenTelemetry, off: servewell traces and counts every request itself
#: (observability/tracing.py, metrics.py); FastAPI's would add a second server span, and its
#: per-request check of the global providers cost 1-4% of an ingress process's CPU (py-spy).
NO_FRAMEWORK_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


class ServewellApp(FastAPI):
    """The FastAPI app, entered through servewell's own request chain (`front`: request context,
    API key, HEAD as GET, the inference fast path) before FastAPI's own middleware.

    Outside FastAPI, an inference request that the fast path takes never passes FastAPI's error,
    telemetry and body-limit layers (3-5% of an ingress process's CPU on the tiny MLP, py-spy):
    its errors are answered by the fast path and, unexpected ones, by the request context. Every
    other request continues into FastAPI (`framework`) as before. The lifespan goes to FastAPI."""

    front: ASGIApp | None = None

    def build_middleware_stack(self) -> ASGIApp:
        """FastAPI's stack less its outermost layer, Starlette's server-error middleware: inside
        `front`, the request context middleware is the last resort (it logs an unexpected error
        and answers the JSON 500, or counts a client that left as 499), as when it ran outside."""
        stack = super().build_middleware_stack()
        return stack.app if self.front is not None and isinstance(stack, ServerErrorMiddleware) else stack

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI itself: its middleware, routing and exception handlers."""
        await super().__call__(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.front is None or scope["type"] == "lifespan":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # as Starlette sets it: the routes find the app state through it
        await self.front(scope, receive, send)


def _fast_path_counter(metrics: ServeMetrics | None) -> Callable[[HotRoute], None] | None:
    if metrics is None:
        return None
    counter = metrics.fast_path_requests

    def count(route: HotRoute) -> None:
        counter.labels(route.path).inc()

    return count
