"""Builds the FastAPI application from an `AppState`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

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
    app = FastAPI(title="servewell", version=servewell.__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
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
    # Innermost: POST to an inference path runs its endpoint here, past FastAPI's routing and
    # dependency solving (api/hot_routes.py); the routes stay registered above for /openapi.json
    # and for every request the dispatcher leaves to FastAPI.
    table = HotRouteTable([*routes_simple.hot_routes(), *routes_v2.hot_routes()])
    app.add_middleware(HotRouteDispatcher, table=table, on_error=answer_serve_error,
                       on_dispatch=_fast_path_counter(state.metrics))
    # Added last runs first: the request context (id, metrics, logs) wraps the key check; HEAD is
    # turned into GET inside both, so logs and metrics still say HEAD.
    app.add_middleware(HeadAsGetMiddleware)
    # Added last runs first: the request context (id, metrics, logs) wraps the key check.
    app.add_middleware(ApiKeyMiddleware, access=state.access, knobs=state.knobs,
                       rule=lambda: access_rule(state.settings, state.access))
    app.add_middleware(RequestContextMiddleware, knobs=state.knobs, metrics=state.metrics, tracing=tracing,
                       recent=state.console.recent)
    return app


def _fast_path_counter(metrics: ServeMetrics | None) -> Callable[[HotRoute], None] | None:
    if metrics is None:
        return None
    counter = metrics.fast_path_requests

    def count(route: HotRoute) -> None:
        counter.labels(route.path).inc()

    return count
