"""HEAD answered as GET without its body (RFC 9110, section 9.3.2).

FastAPI's routes list GET alone, so HEAD on a GET route got 405. Rewriting the method for the app
is enough: uvicorn keeps the request's own scope, sees HEAD there, and sends the head only (with
the Content-Length the GET would have had). A route without GET still answers 405.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HeadAsGetMiddleware:
    """Passes HEAD requests to the app as GET; the server drops the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)
