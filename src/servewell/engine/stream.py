"""A stream: one request whose outcome arrives in parts.

A streamed request enters the same admission chain as any other (`InferenceEngine.submit_stream`:
version, tenant quota, deadline, lane, payload log, canary judge and metrics all apply) and gets
the same kind of outcome future, which resolves once, when the stream ends, with the whole
answer or the `ServeError` that ended it. Its parts go meanwhile to a `PartSink` handed in with
the request: in the process that answers the client, a `PartBuffer` (bounded: a client that reads
more slowly than the model writes has its stream ended with `stream_too_slow`, never the server's
memory grown); across the door between an ingress and the engine, `StreamPartOut` messages.

A model that does not answer in parts (no `generate:` section) streams too: its one answer is the
stream's one part (Triton's ModelStreamInfer on a non-decoupled model behaves the same).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.shared_tensors import SharedTensors
from servewell.errors import StreamTooSlow


@dataclass(slots=True)
class StreamPart:
    """One part of a stream's answer: the outputs the model made at one step for this request."""

    outputs: dict[str, np.ndarray]
    index: int  # 0 for the first part
    made_at: float  # when the engine had it: absolute `time.monotonic()` seconds

    def __reduce__(self) -> tuple[type[StreamPart], tuple[object, ...]]:
        return (StreamPart, (self.outputs, self.index, self.made_at))


class PartSink(Protocol):
    """Where a stream's parts go as they are made."""

    def put(self, part: StreamPart) -> bool:
        """Take `part`; False when it cannot (its reader is too slow or gone): the stream then ends."""
        ...


# --- across the door ----------------------------------------------------------------------------


@dataclass(slots=True)
class StreamOpen:
    """An ingress asks for a stream: like `Envelope`, whose outcome comes as one `Outcome` after
    the stream's parts, each a `StreamPartOut` naming the same `call_id`."""

    call_id: int
    request: InferenceRequest
    shared: SharedTensors | None = None

    def __reduce__(self) -> tuple[type[StreamOpen], tuple[object, ...]]:
        return (StreamOpen, (self.call_id, self.request, self.shared))


@dataclass(slots=True)
class StreamPartOut:
    """One part of the stream `call_id`, from the engine to the ingress that opened it."""

    call_id: int
    part: StreamPart

    def __reduce__(self) -> tuple[type[StreamPartOut], tuple[object, ...]]:
        return (StreamPartOut, (self.call_id, self.part))


# --- in the process that answers the client -----------------------------------------------------


class PartBuffer:
    """The parts of one stream waiting for their reader (an async iterator), at most `limit`.

    `attach(outcome)` gives it the stream's outcome future: iteration ends once that is done and
    every part before it was read. A part that finds the buffer full ends the stream: the outcome
    is cancelled (the engine frees the sequence at its next step) and the reader, once it has
    read what is buffered, gets `StreamTooSlow`."""

    __slots__ = ("_parts", "_limit", "_outcome", "_waiter", "too_slow", "received", "first_at")

    def __init__(self, limit: int) -> None:
        self._parts: deque[StreamPart] = deque()
        self._limit = max(1, limit)
        self._outcome: asyncio.Future[RequestResult] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.too_slow = False
        self.received = 0  # parts taken, the dropped one included
        self.first_at: float | None = None  # when the first part arrived (`time.monotonic()`)

    def attach(self, outcome: asyncio.Future[RequestResult]) -> None:
        """The stream's outcome: its end wakes the reader."""
        self._outcome = outcome
        outcome.add_done_callback(lambda _: self._wake())

    def put(self, part: StreamPart) -> bool:
        """Buffer `part` for the reader (`PartSink`)."""
        if self.too_slow:
            return False
        self.received += 1
        if len(self._parts) >= self._limit:
            self.too_slow = True
            if self._outcome is not None and not self._outcome.done():
                self._outcome.cancel()  # frees the sequence at the next step (over the door too: `Cancel`)
            self._wake()
            return False
        if self.first_at is None:
            self.first_at = time.monotonic()  # finer than the loop's clock (uvloop: whole milliseconds)
        self._parts.append(part)
        self._wake()
        return True

    @property
    def buffered(self) -> int:
        """Parts waiting to be read."""
        return len(self._parts)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> PartBuffer:
        return self

    async def __anext__(self) -> StreamPart:
        while True:
            if self._parts:
                return self._parts.popleft()
            if self.too_slow:
                raise StreamTooSlow(f"the client read more slowly than the model wrote: {self._limit} parts were "
                                    "waiting for it, so the stream was ended")
            if self._outcome is not None and self._outcome.done():
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


def whole_answer(parts: list[dict[str, np.ndarray]], open_axes: dict[str, int | None]) -> dict[str, np.ndarray]:
    """The answer a stream's parts make together (what a non-streamed request of a generative
    model gets, and what the payload log and the canary judge see): each output's parts joined
    along its first open (-1) per-row axis (`open_axes[name]`, counted after the row axis), or
    stacked along a new axis 1 when it has none (None)."""
    if not parts:
        return {}
    joined: dict[str, np.ndarray] = {}
    for name in parts[0]:
        pieces = [part[name] for part in parts if name in part]
        axis = open_axes.get(name)
        if axis is not None and all(piece.ndim > axis + 1 for piece in pieces):
            joined[name] = np.concatenate(pieces, axis=axis + 1)
        else:
            joined[name] = np.stack(pieces, axis=1) if pieces[0].ndim else np.stack(pieces)
    return joined
