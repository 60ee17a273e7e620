"""One streamed request in the process that answers its client: the data plane's `InferenceCall`
(resolve, lane, admission, deadline) opened as a stream (`ServingEngine.submit_stream`), its parts
read from a bounded `PartBuffer`, and its end (the whole answer's timings, or the error that ended
it) as one `StreamEnd`. Every streaming route (SSE, gRPC ModelStreamInfer, the OpenAI API) reads a
stream through this, so a disconnect, a slow reader and a deadline end every protocol's stream
the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from servewell.api.dataplane import InferenceCall
from servewell.engine.protocol import RequestResult
from servewell.engine.stream import PartBuffer, StreamPart
from servewell.errors import ModelError, ServeError
from servewell.observability.context import stages_var

#: Parts buffered for a model without a `generate:` section (its one answer is one part).
ONE_PART = 2


@dataclass(slots=True)
class StreamEnd:
    """How a stream ended: its result (None when an error ended it), the error, why it stopped
    (`stop`, `length`, or `error`), the parts it had and its `Server-Timing` figures."""

    result: RequestResult | None
    error: ServeError | None
    finish_reason: str
    parts: int
    server_timing: str


class StreamCall:
    """A stream opened on an `InferenceCall` (after `open` and the inputs' decoding)."""

    __slots__ = ("_call", "_buffer", "_outcome", "_limit", "_generative", "_started", "end")

    def __init__(self, call: InferenceCall) -> None:
        self._call = call
        generate = call.model.config.generate
        self._generative = generate is not None
        self._buffer = PartBuffer(generate.stream_buffer_parts if generate is not None else ONE_PART)
        self._outcome: asyncio.Future[RequestResult] | None = None
        self._limit = generate.max_outputs if generate is not None else 1
        self._started = time.perf_counter()
        self.end: StreamEnd | None = None

    def open(self, inputs: dict[str, np.ndarray], *, priority: object = None, timeout_ms: float | None = None,
             not_after: float | None = None, oip_id: str | None = None, max_outputs: int = 0) -> None:
        """Submit the stream (a refusal raises here, before anything was sent to the client)."""
        if max_outputs > 0:
            self._limit = min(self._limit, max_outputs)
        request = self._call.request_for(inputs, priority=priority, timeout_ms=timeout_ms, not_after=not_after,
                                         oip_id=oip_id, max_outputs=max_outputs)
        self._outcome = self._call.plane.engine.submit_stream(request, self._buffer)
        self._buffer.attach(self._outcome)

    def cancel(self) -> None:
        """The client went away: the engine frees the sequence at its next step."""
        if self._outcome is not None and not self._outcome.done():
            self._outcome.cancel()

    async def parts(self) -> AsyncIterator[StreamPart]:
        """Each part as it comes; then `end` says how the stream ended (read it after the loop)."""
        outcome = self._outcome
        if outcome is None:
            raise RuntimeError("StreamCall.open() must come first")
        try:
            async for part in self._buffer:
                yield part
        except ServeError as slow:  # too slow
            self.end = self._ended(None, slow)
            return
        if outcome.cancelled():
            self.end = self._ended(None, ModelError("the stream was cancelled"))
            return
        error = outcome.exception()
        if error is not None:
            serve = error if isinstance(error, ServeError) else ModelError(f"the stream failed: {error}")
            self.end = self._ended(None, serve)
            return
        result = outcome.result()
        if not self._generative or self._buffer.received == 0:
            # A model that answers whole (or a generator that made its one answer at once): one part.
            if result.outputs and self._buffer.received == 0:
                self._buffer.first_at = time.monotonic()
                yield StreamPart(result.outputs, 0, time.monotonic())
                self._buffer.received = 1
        self.end = self._ended(result, None)

    def _ended(self, result: RequestResult | None, error: ServeError | None) -> StreamEnd:
        received = self._buffer.received - (1 if self._buffer.too_slow else 0)
        first = self._buffer.first_at
        first_ms = (first - self._call.arrived_at) * 1000 if first is not None else None
        if result is not None:
            timing = self._call.finish(result)
            reason = "length" if self._generative and received >= self._limit else "stop"
        else:
            timing = f"total;dur={(time.perf_counter() - self._started) * 1000:.3f}"
            reason = "error"
        if first_ms is not None:
            timing += f", first_output;dur={first_ms:.3f}"
            stages = stages_var.get()
            if stages is not None:  # the slow-request log line and the console's record show it
                stages["first_output"] = first_ms / 1000
        return StreamEnd(result, error, reason, received, timing)
