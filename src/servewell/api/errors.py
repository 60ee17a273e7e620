"""Every error leaves as JSON with the right status, a stable code and the request id.

Two shapes, by route: the Open Inference Protocol's (`/v2/...`) is `{"error": "<message>", "code",
"request_id"}`, because OIP clients read `error` as the message string (tritonclient's
`InferenceServerException` kept a dict there, and `str(e)` raised TypeError on every 4xx/5xx);
every other route (`/predict`, `/admin`, `/console`, ...) answers `{"error": {"code", "message",
"request_id"}}`. Both carry the code in `X-Error-Code` too (and the id in `X-Request-ID`)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from servewell.errors import ServeError, Unavailable, quote
from servewell.observability.context import error_code_var, model_var, request_id_var
from servewell.observability.refusal_log import RefusalDigest

log = logging.getLogger("servewell.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 400: "bad_request",
               413: "payload_too_large", 415: "unsupported_media_type", 422: "invalid_input"}


def is_oip_path(path: str) -> bool:
    """Whether `path` is an Open Inference Protocol route, whose errors take OIP's shape."""
    return path == "/v2" or path.startswith("/v2/")


def error_document(path: str, code: str, message: str, request_id: str) -> dict[str, Any]:
    """The JSON error body for a request to `path` (the module docstring gives both shapes)."""
    if is_oip_path(path):
        return {"error": message, "code": code, "request_id": request_id}
    return {"error": {"code": code, "message": message, "request_id": request_id}}


def error_response(status: int, code: str, message: str, retry_after_s: float | None = None,
                   headers: dict[str, str] | None = None, *, path: str = "") -> Response:
    """A JSON error response to a request for `path`, carrying the current request id."""
    body = error_document(path, code, message, request_id_var.get())
    error_code_var.set(code)  # each request runs in its own task (context), so this never leaks to the next
    headers = dict(headers or {})
    headers["X-Error-Code"] = code
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def serve_error_response(exc: ServeError, refusals: RefusalDigest | None = None, *, path: str = "") -> Response:
    """Response for a `ServeError` to a request for `path`, logged once (4xx at info, 5xx at warning); refusals (503)
    go to `refusals`, which logs them per model, code and second with a count."""
    if refusals is not None and isinstance(exc, Unavailable):
        refusals.refused(model_var.get(), exc.code, exc.status, exc.message, exc.tenant)
    else:
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        log.log(level, "request failed: %s", exc.message, extra={"status": exc.status, "code": exc.code})
    retry = exc.retry_after_s if exc.status in (429, 503) else None
    return error_response(exc.status, exc.code, exc.message, retry, exc.headers, path=path)


def allowed_methods(request: Request) -> list[str]:
    """Methods /openapi.json documents for this request's path (empty when it documents none).

    From the schema, because FastAPI keeps included routers behind private wrappers, and because
    the documented methods are what a client (or schemathesis) holds `Allow` to."""
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, request.url.path):
            methods |= {method.upper() for method in operations}
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> Callable[[ServeError, str], Response]:
    """Map framework and servewell exceptions onto the JSON error shape; returns the `ServeError`
    answer (exception, request path) for the routes FastAPI does not dispatch (api/hot_routes.py),
    sharing the handler's refusal digest."""
    refusals = RefusalDigest(log)

    def answer_serve_error(exc: ServeError, path: str) -> Response:
        return serve_error_response(exc, refusals, path=path)

    async def on_serve_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServeError)
        return answer_serve_error(exc, request.scope["path"])

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        response = error_response(exc.status_code, code, str(exc.detail), path=request.scope["path"])
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            # RFC 9110: `Allow` lists every method of the resource. Starlette names only the first
            # route whose path matched (GET of GET + PATCH /admin/.../batching).
            methods = allowed_methods(request)
            if methods:
                response.headers["Allow"] = ", ".join(methods)
        return response

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(422, "invalid_input", f"field {quote(where)}: {first.get('msg')}",
                              path=request.scope["path"])

    app.add_exception_handler(ServeError, on_serve_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    return answer_serve_error
