"""What a model's scheduler keeps of each request and counts: the request's record while it
queues and runs (`Request`), the scheduler's counters, and answering a request with an error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from servewell.engine.batch_queue import QueuedItem
from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.errors import ServeError
from servewell.observability.batch_telemetry import TraceMark


@dataclass(slots=True)
class PendingRequest:
    """What a queued or running request carries; the queue's `QueuedItem` holds it with its
    lane, rows, shape and deadline, and that item is the request's one record."""

    request: InferenceRequest
    future: asyncio.Future[RequestResult]
    trace: TraceMark | None = None
    queued_at: float = 0.0  # when it was queued, on the precise clock (`clock.precise_time`)
    queue_s: float = 0.0  # from then until its batch was handed over (set then)


Request = QueuedItem[PendingRequest]


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start, for health and benchmarks."""

    batches: int = 0
    rows: int = 0
    expired: int = 0
    cancelled: int = 0
    rejected: int = 0
    isolated_batches: int = 0  # failed batches whose requests were run again one by one


def fail(item: Request, error: ServeError) -> None:
    """Answer `item` with `error` unless it was answered (or cancelled) already."""
    if not item.payload.future.done():
        item.payload.future.set_exception(error)


def failed(item: Request) -> bool:
    """Whether `item` was answered with an error."""
    future = item.payload.future
    return future.done() and not future.cancelled() and future.exception() is not None
