"""Pure ASGI middleware: request id, X-Process-Time, and a JSON 500 for anything unexpected.

Pure ASGI (not BaseHTTPMiddleware) so it adds no task or body copy per request.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servewell.api.errors import error_response
from servewell.observability.context import model_var, request_id_var

log = logging.getLogger("servewell.api")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


class RequestContextMiddleware:
    """Assigns (or accepts a safe client-supplied) `X-Request-ID` and times the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = ""
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                candidate = value.decode("latin-1")
                if _SAFE_ID.match(candidate):
                    request_id = candidate
                break
        request_id = request_id or uuid.uuid4().hex
        token = request_id_var.set(request_id)
        model_token = model_var.set("")
        response_started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                headers.append((b"x-process-time", f"{time.perf_counter() - started:.6f}".encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            log.exception("unhandled error while serving %s %s", scope.get("method"), scope.get("path"))
            if not response_started:
                response = error_response(500, "internal", "internal server error; the request id is in this body")
                await response(scope, receive, send_with_headers)
        finally:
            request_id_var.reset(token)
            model_var.reset(model_token)
