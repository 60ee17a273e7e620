"""What the limited HTTP protocol answers when it refuses a request, written without the app:
complete JSON error responses, and small ASGI apps for refusals that wait their turn."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from servewell.api.errors import error_document
from servewell.observability.context import new_request_id


class StopParsing(Exception):
    """Raised in a parser callback once a connection has queued all the requests it may: parsing stops."""


class Refusal(Exception):
    """A limit crossed inside a parser callback: answer `status` with the JSON error and close."""

    def __init__(self, status: int, code: str, message: str, event: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.event = status, code, message, event


def error_head_and_body(status: int, code: str, message: str, retry_after_s: int | None = None,
                        extra_headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A complete `Connection: close` HTTP/1.1 response carrying the JSON error body."""
    request_id = new_request_id()
    body = orjson.dumps({"error": {"code": code, "message": message, "request_id": request_id}})
    headers = list(extra_headers or [])
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"), (b"x-request-id", request_id.encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    lines = [STATUS_LINE[status], *(name + b": " + value + b"\r\n" for name, value in headers), b"\r\n", body]
    return b"".join(lines)


def unavailable_app(message: str) -> ASGIApp:
    """An app answering every request 503 `unavailable` with `message` and a one-second retry hint."""

    async def unavailable(scope: Scope, receive: Receive, send: Send) -> None:
        request_id = new_request_id()
        body = orjson.dumps(error_document(scope["path"], "unavailable", message, request_id))
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"), (b"x-request-id", request_id.encode()), (b"x-error-code", b"unavailable")]})
        await send({"type": "http.response.body", "body": body})

    return unavailable


#: What a reserve connection gets for anything but a probe path.
connection_limit_app = unavailable_app("the server is at its connection limit; retry shortly")
