"""`EventStreamResponse`: events written as they come, a client that stops reading ends its stream
after the write timeout (and only then), a disconnect ends it at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from servewell.api.sse import EventStreamResponse, sse_event

#: A response that has not ended by then fails its test (a broken write watch would hang it).
BOUND_S = 10.0


async def _events(count: int, gap_s: float = 0.0) -> AsyncIterator[bytes]:
    for index in range(count):
        if gap_s:
            await asyncio.sleep(gap_s)
        yield sse_event({"index": index})


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_every_event_is_written_then_the_body_ends() -> None:
    sent: list[MutableMapping[str, Any]] = []
    ended: list[bool] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        response = EventStreamResponse(_events(3), on_disconnect=lambda: ended.append(True), write_timeout_s=0.2)
        await asyncio.wait_for(response({"type": "http"}, _never_disconnects, send), BOUND_S)

    asyncio.run(main())
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [sse_event({"index": i}) for i in range(3)] + [b""]
    assert sent[-1]["more_body"] is False and not ended


def test_a_write_the_client_does_not_take_ends_the_stream_after_the_timeout() -> None:
    ended: list[float] = []
    writes = [0]

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            writes[0] += 1
            if writes[0] == 2:  # the client stops reading at the second event
                await asyncio.Event().wait()

    async def main() -> float:
        began = time.monotonic()
        response = EventStreamResponse(_events(5), on_disconnect=lambda: ended.append(time.monotonic()),
                                       write_timeout_s=0.4)
        await asyncio.wait_for(response({"type": "http"}, _never_disconnects, send), BOUND_S)
        return began

    began = asyncio.run(main())
    assert writes[0] == 2 and len(ended) == 1
    assert 0.4 <= ended[0] - began < 1.5  # the timeout, then at most one check's interval later


def test_slow_parts_are_not_a_slow_client() -> None:
    """Waiting for the model's next part is not a write: only a write in progress is timed."""
    ended: list[bool] = []
    sent: list[bytes] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    async def main() -> None:
        response = EventStreamResponse(_events(3, gap_s=0.3), on_disconnect=lambda: ended.append(True),
                                       write_timeout_s=0.2)
        await asyncio.wait_for(response({"type": "http"}, _never_disconnects, send), BOUND_S)

    asyncio.run(main())
    assert len(sent) == 4 and not ended


def test_a_cancellation_from_outside_still_cancels() -> None:
    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()

    async def main() -> bool:
        response = EventStreamResponse(_events(3), on_disconnect=lambda: None, write_timeout_s=5.0)
        task = asyncio.ensure_future(response({"type": "http"}, _never_disconnects, send))
        await asyncio.sleep(0.1)
        task.cancel()
        try:
            await asyncio.wait_for(task, BOUND_S)
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(main())
