"""Reading request bodies with a size limit and a content-type check."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from servewell.config.problems import field_problems
from servewell.errors import BadRequest, ClientClosed, InvalidInput, PayloadTooLarge, UnsupportedMediaType, quote

M = TypeVar("M", bound=BaseModel)


def check_content_type(request: Request, allowed: tuple[str, ...]) -> None:
    """415 unless the Content-Type is absent or one of `allowed`."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in allowed:
        raise UnsupportedMediaType(f"Content-Type {quote(media)} is not accepted here; send {' or '.join(allowed)}")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) one that declares or streams more than `limit` bytes;
    `ClientClosed` when the client goes away before the end."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if chunk:  # the last message is often empty: one real chunk then needs no join (no copy)
                chunks.append(chunk)
    except ClientDisconnect:
        # The client's choice, not a server error: a 499 that nobody reads, logged at INFO.
        raise ClientClosed(f"the client disconnected after sending {size} bytes of the body") from None
    return b"".join(chunks)


def json_object(body: bytes) -> dict[str, Any]:
    """`body` parsed as one JSON object: 400 for text that is not JSON or JSON that is not an object."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(doc).__name__}")
    return doc


async def read_json_patch(request: Request, limit: int, model: type[M]) -> M:
    """An admin PATCH body: JSON (415 otherwise), at most `limit` bytes, checked by `model` (400 for
    JSON that does not parse, 422 naming the first few problems; field names come from the client,
    so each problem is cut short)."""
    check_content_type(request, ("application/json",))
    try:
        raw: Any = orjson.loads(await read_body(request, limit))
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput("; ".join(str(p)[:200] for p in field_problems(exc)[:5])) from None


class GatheredBody:
    """A request body arriving in chunks, joined once when it is all in (`bytes +=` per chunk
    copied the whole body again each time): chunks of 4 KiB or more kept as they came, smaller
    ones gathered into a bytearray, so a slow client's 1-byte chunks cost no object each."""

    WHOLE_CHUNK = 4096

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes | bytearray] = []

    def add(self, chunk: bytes) -> None:
        """One more chunk, in order."""
        parts = self._parts
        if len(chunk) >= self.WHOLE_CHUNK:
            parts.append(chunk)
        elif parts and isinstance(parts[-1], bytearray):
            parts[-1] += chunk
        else:
            parts.append(bytearray(chunk))

    def take(self) -> bytes:
        """The whole body (one chunk that came whole is not copied); the gatherer starts empty again."""
        parts, self._parts = self._parts, []
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)
