"""Reading servewell's JSON error bodies in tests, each checked against its route's shape.

The Open Inference Protocol's routes (`/v2/...`) answer `{"error": "<message>", "code",
"request_id"}` (what tritonclient reads); every other route `{"error": {"code", "message",
"request_id"}}`."""

from __future__ import annotations

import httpx


def error_of(response: httpx.Response) -> dict[str, str]:
    """`{"code", "message", "request_id"}` of an httpx error response, after checking that the body
    has its route's shape and that the code is in `X-Error-Code` too."""
    doc = response.json()
    path = response.request.url.path
    if path == "/v2" or path.startswith("/v2/"):
        assert isinstance(doc.get("error"), str), doc
        error = {"code": doc["code"], "message": doc["error"], "request_id": doc["request_id"]}
    else:
        assert isinstance(doc.get("error"), dict), doc
        error = doc["error"]
    assert response.headers.get("x-error-code") == error["code"], (dict(response.headers), doc)
    return error


def error_code(response: httpx.Response) -> str:
    """The stable code of an httpx error response (its shape checked as `error_of` does)."""
    return error_of(response)["code"]
