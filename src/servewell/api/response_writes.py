"""A response's status line and headers leave in the same write as its first body bytes.

uvicorn writes a response in two `transport.write` calls: the head when the app sends
`http.response.start`, the body when it sends `http.response.body`. A process killed between the
two (SIGKILL, the OOM killer, a node going away) leaves the peer with a head and no body, which a
load balancer can no longer hide: HAProxy had already forwarded the head, so it logged `SD--` and
closed the client's connection mid-response instead of retrying the request on another replica
(seen about once in 15 `kill -9`s under load through HAProxy, tests/integration/deploy). With the
head held back until the body, a small response is one send: the peer gets all of it or none of
it, and "none" is the case `retry-on empty-response` replays. It also saves a syscall per response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

#: A body this large leaves with its head through `writelines` rather than joined to it: joining
#: copied a 588 KiB binary answer once more in the ingress (bench.shared_tensors).
_JOIN_BELOW = 16 << 10


class HeadHoldingTransport:
    """What a uvicorn request/response cycle writes through: while `holding`, writes are kept (the
    head); the next write, `flush()` or `close()` sends them first, joined with what follows."""

    __slots__ = ("_transport", "_held", "holding")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held = b""
        self.holding = False

    def write(self, data: bytes) -> None:
        if self.holding:
            self._held += data
            return
        if self._held:
            held, self._held = self._held, b""
            if len(data) >= _JOIN_BELOW:
                # One vectored write (uvloop's writev) instead of copying a large body behind the head.
                self._transport.writelines((held, data))
                return
            data = held + data
        self._transport.write(data)

    def flush(self) -> None:
        if self._held:
            self._transport.write(self._held)
            self._held = b""

    def close(self) -> None:
        self.flush()  # the app failed after starting its response: the head goes, as before, then the close
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def hold_heads(cycle: Any) -> None:
    """Make uvicorn's request/response `cycle` (not yet running its app) send each response's head
    with the first body write. Relies on the cycle writing through its `transport` attribute and
    handing the app its `send` attribute, as uvicorn's httptools and h11 cycles do."""
    transport = HeadHoldingTransport(cycle.transport)
    cycle.transport = transport
    send = cycle.send

    async def send_holding_the_head(message: Message) -> None:
        if message["type"] == "http.response.start":
            transport.holding = True
            try:
                await send(message)
            finally:
                transport.holding = False
            return
        await send(message)
        if not message.get("more_body", False):
            transport.flush()  # a HEAD answer (or an empty body) writes nothing after the head
            # The cycle holds this function, which holds the cycle's own `send`: a reference cycle
            # per request, left to the cyclic collector, whose young collections then paused an
            # ingress process 10-30 ms at a time under load (tests/unit/api/test_reference_cycles.py).
            # The response is complete: nothing sends again.
            vars(cycle).pop("send", None)

    cycle.send = send_holding_the_head


class PartsResponse(Response):
    """A response whose body is sent as the parts it was made of (`Content-Length` their sum): a
    large binary answer goes from the arrays it was read into (the engine's shared memory) to the
    socket without being joined into one more copy on the event loop (60 MB: about 50 ms)."""

    def __init__(self, parts: Sequence[bytes | memoryview], status_code: int, headers: Mapping[str, str],
                 media_type: str) -> None:
        self.parts = list(parts)
        super().__init__(b"", status_code, dict(headers), media_type)
        self.headers["content-length"] = str(sum(memoryview(part).nbytes for part in self.parts))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for index, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": index < last})
        if last < 0:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def parts_response(parts: Sequence[bytes | memoryview], status_code: int, headers: Mapping[str, str],
                   media_type: str) -> Response:
    """A plain `Response` for a body of one bytes part, else a `PartsResponse`."""
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return Response(parts[0], status_code, dict(headers), media_type)
    return PartsResponse(parts, status_code, headers, media_type)
