"""Server-sent events: how a stream's parts reach an HTTP client (`text/event-stream`).

`EventStreamResponse` writes each event as it comes and watches the connection meanwhile: a
client that disconnects ends its stream at once (`on_disconnect`: the engine frees the sequence
at its next step), and a write that the client does not take within `write_timeout_s` (it stopped
reading; its socket buffers are full) ends the response: the server never holds more than one
event per such client beyond what the stream's bounded buffer holds (engine/stream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("servewell.api")

#: How long one event's write may wait for a client that does not read before the stream ends.
WRITE_TIMEOUT_S = 10.0


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One event: `data` as JSON (or a str as it is) on one `data:` line, with an `event:` name."""
    body = data if isinstance(data, str) else orjson.dumps(data).decode()
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n".encode()


class EventStreamResponse(Response):
    """A `text/event-stream` response written from `events` (see the module docstring)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, on_disconnect: Callable[[], None],
                 headers: Mapping[str, str] | None = None, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        super().__init__(None, 200, {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
                         self.media_type)
        # Its length is not known: no Content-Length (the body ends when the connection's last chunk does).
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._events = events
        self._on_disconnect = on_disconnect
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            self._on_disconnect()

        watcher = asyncio.ensure_future(watch())
        writes = _WriteWatch(self._write_timeout_s)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self._events:
                if gone.is_set():
                    break
                try:
                    with writes:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except (_TooSlow, OSError):
                    self._on_disconnect()  # it stopped reading: the stream ends, the connection closes
                    gone.set()
                    break
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            writes.close()
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
            closer = getattr(self._events, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()


class _TooSlow(Exception):
    """A write waited for its client longer than the write timeout."""


class _WriteWatch:
    """Ends a write that waits longer than `timeout_s` (`_TooSlow` from the `with` block around it).

    A write to a client that reads returns without waiting (it lands in the socket's buffer), so a
    per-write timer (`asyncio.wait_for`: a task a write) cost more than the event's encoding did.
    One check every `timeout_s / 4` (at most a second) looks at the write in progress and cancels
    the writer's task if it began over `timeout_s` ago."""

    __slots__ = ("_timeout_s", "_interval_s", "_loop", "_task", "_since", "_stuck", "_timer")

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._interval_s = min(1.0, timeout_s / 4)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._since: float | None = None  # when the write in progress began
        self._stuck = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(self._interval_s, self._check)

    def __enter__(self) -> None:
        self._since = self._loop.time()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: object) -> None:
        self._since = None
        if kind is asyncio.CancelledError and self._stuck and self._task is not None:
            self._task.uncancel()  # this watch's own cancellation: the write is over, the stream ends
            raise _TooSlow()

    def _check(self) -> None:
        since = self._since
        if since is not None and self._loop.time() - since >= self._timeout_s and self._task is not None:
            self._stuck = True  # the task waits in this write (`_since` is cleared as soon as it returns)
            self._task.cancel()
            self._timer = None
            return
        self._timer = self._loop.call_later(self._interval_s, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
