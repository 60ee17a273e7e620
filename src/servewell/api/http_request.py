"""What the HTTP routes read from a request besides its body: urgency, deadline, disconnects."""

from __future__ import annotations

import re

from fastapi import Request

from servewell.errors import InvalidInput, quote

#: A positive decimal number of milliseconds, as /openapi.json states it (no exponent, sign or "inf").
TIMEOUT_PATTERN = r"^(?:[0-9]{0,12}[1-9][0-9]{0,12}(?:\.[0-9]{1,6})?|[0-9]{1,12}\.[0-9]{0,6}[1-9][0-9]{0,6})$"
_TIMEOUT = re.compile(TIMEOUT_PATTERN)

URGENCY_HEADER = "x-urgency"
TIMEOUT_HEADER = "x-request-timeout-ms"


def urgency_of(request: Request) -> str | None:
    """The `X-Urgency` header (a lane rule of engine/lanes.py decides what it means), if given."""
    value = request.headers.get(URGENCY_HEADER)
    return value if value else None


def timeout_ms_of(request: Request) -> float | None:
    """Deadline in ms from `X-Request-Timeout-Ms`, if given (422 when not a positive number)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    value = float(raw) if _TIMEOUT.fullmatch(raw) else -1.0
    if not value > 0:
        raise InvalidInput(f"header X-Request-Timeout-Ms must be a positive number of milliseconds, got {quote(raw)}")
    return value


async def disconnected(request: Request) -> None:
    """Completes when the client disconnects. Call it once the body has been read: the next ASGI
    message is then the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
