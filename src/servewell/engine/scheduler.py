"""Per-model scheduler: admits requests into priority lanes and feeds free workers batches.

Event-driven: it acts when a request arrives, when a worker becomes free, and on one timer
(the earliest of "window closes" and "a queued deadline passes"). It never polls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.batch_queue import BatchQueue, QueuedItem
from servewell.errors import DeadlineExceeded, ModelError, Overloaded, ServeError, ShuttingDown, WorkerLost

#: Lane names in priority order; lane 0 goes first.
LANES: tuple[str, ...] = ("high", "normal")


@dataclass(slots=True)
class RequestResult:
    """What a request gets back: its own rows of every output plus its timings."""

    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_size: int


@dataclass(slots=True)
class PendingRequest:
    """A request while it is queued or running."""

    inputs: dict[str, np.ndarray]
    request_id: str
    future: asyncio.Future[RequestResult]
    enqueued_at: float
    dispatched_at: float = 0.0
    item: QueuedItem | None = field(default=None, repr=False)


class ModelScheduler:
    """Queues requests for one model and runs them in batches on its workers."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._queue: BatchQueue[PendingRequest] = BatchQueue(len(LANES), config.batching.max_queue_size)
        self._idle: list = []  # WorkerHandle
        self._running = 0
        self._timer: asyncio.TimerHandle | None = None
        self._accepting = True
        self._drained: asyncio.Event | None = None
        self._batch_s_ema: float | None = None

    # --- workers -------------------------------------------------------------------------

    def add_worker(self, worker) -> None:  # noqa: ANN001 - WorkerHandle
        """Make a ready worker available for batches."""
        self._idle.append(worker)
        self._pump()

    def remove_worker(self, worker) -> None:  # noqa: ANN001
        """Forget a worker (it died or is being stopped)."""
        if worker in self._idle:
            self._idle.remove(worker)

    # --- requests ------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting, all lanes together."""
        return len(self._queue)

    @property
    def running_batches(self) -> int:
        """Batches on workers right now."""
        return self._running

    def submit(
        self, inputs: dict[str, np.ndarray], rows: int, lane: int, timeout_ms: float | None, request_id: str
    ) -> asyncio.Future[RequestResult]:
        """Queue a request; its future resolves with the result or a `ServeError`.

        Raises `Overloaded` at once when the lane is full, `ShuttingDown` while draining.
        """
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        loop = asyncio.get_running_loop()
        now = loop.time()
        timeout_s = (timeout_ms if timeout_ms is not None else self.config.batching.default_timeout_ms) / 1000.0
        future: asyncio.Future[RequestResult] = loop.create_future()
        pending = PendingRequest(inputs, request_id, future, now)
        shape_key = tuple((name, a.shape[1:], a.dtype.str) for name, a in inputs.items())
        item = QueuedItem(pending, lane, rows, shape_key, now + timeout_s, now)
        if not self._queue.push(item):
            raise Overloaded(
                f"model '{self.config.name}' has {self._queue.depth(lane)} requests queued in lane "
                f"'{LANES[lane]}', its limit",
                retry_after_s=self._predicted_drain_s(),
            )
        pending.item = item
        future.add_done_callback(lambda f, it=item: f.cancelled() and self._on_cancel(it))
        self._pump()
        return future

    def _on_cancel(self, item: QueuedItem) -> None:
        self._queue.cancel(item)
        self._check_drained()

    # --- the pump ------------------------------------------------------------------------

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for item in self._queue.expire(now):
            _fail(item.payload, DeadlineExceeded(
                f"the request waited {1000 * (now - item.enqueued_at):.0f} ms in the queue and passed its deadline "
                "before the model could run it"
            ))
        wake_at: float | None = None
        max_rows = max(1, self.config.max_batch_size)
        while self._idle and len(self._queue):
            head = self._queue.head()
            if head is None:
                break
            open_until = self._window_closes_at(head, max_rows)
            if open_until is not None and open_until > now:
                wake_at = open_until
                break
            batch = [i.payload for i in self._queue.take_batch(max_rows) if not i.payload.future.done()]
            if not batch:
                continue
            worker = self._idle.pop()
            self._running += 1
            loop.create_task(self._execute(worker, batch))
        deadline = self._queue.next_deadline()
        if deadline is not None and (wake_at is None or deadline < wake_at):
            wake_at = deadline
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake_at is not None:
            self._timer = loop.call_at(wake_at, self._pump)
        self._check_drained()

    def _window_closes_at(self, head: QueuedItem, max_rows: int) -> float | None:
        """When the batch led by `head` must start; None means now."""
        if self.config.batching.policy != "window" or head.lane == 0 or not self._accepting:
            return None
        if self._queue.ready_rows(head.shape_key) >= max_rows:
            return None
        oldest = self._queue.oldest_enqueued_at()
        return (oldest if oldest is not None else head.enqueued_at) + self.config.batching.max_wait_ms / 1000.0

    async def _execute(self, worker, batch: list[PendingRequest]) -> None:  # noqa: ANN001
        loop = asyncio.get_running_loop()
        started = loop.time()
        for request in batch:
            request.dispatched_at = started
        names = [spec.name for spec in self.config.inputs]
        try:
            outcome = await worker.run({name: [r.inputs[name] for r in batch] for name in names})
            results = self._split(outcome.outputs, batch)
        except ServeError as exc:
            for request in batch:
                _fail(request, exc)
        except Exception as exc:  # a bug in our splitting or transport must still resolve every future
            for request in batch:
                _fail(request, ModelError(f"batch failed: {exc}"))
        else:
            elapsed = loop.time() - started
            self._batch_s_ema = elapsed if self._batch_s_ema is None else 0.8 * self._batch_s_ema + 0.2 * elapsed
            rows = sum(r.item.rows for r in batch)
            for request, outputs in zip(batch, results):
                if not request.future.done():
                    request.future.set_result(
                        RequestResult(outputs, started - request.enqueued_at, outcome.compute_s, rows)
                    )
        finally:
            self._running -= 1
            if worker.alive:
                self._idle.append(worker)
            self._pump()

    def _split(self, outputs: dict[str, np.ndarray], batch: list[PendingRequest]) -> list[dict[str, np.ndarray]]:
        if self.config.max_batch_size == 0:
            return [outputs]
        total = sum(r.item.rows for r in batch)
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != total:
                raise ModelError(f"output '{name}' has {array.shape[0] if array.ndim else 0} rows for a batch of {total}")
        results: list[dict[str, np.ndarray]] = []
        start = 0
        for request in batch:
            rows = request.item.rows
            results.append({name: array[start : start + rows] for name, array in outputs.items()})
            start += rows
        return results

    def _predicted_drain_s(self) -> float:
        per_batch = self._batch_s_ema or 0.05
        workers = max(1, len(self._idle) + self._running)
        batches = len(self._queue) / max(1, self.config.max_batch_size) / workers
        return max(1.0, round(batches * per_batch + 0.5))

    # --- lifecycle -----------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop admitting and wait until every queued and running request has resolved."""
        self._accepting = False
        self._drained = asyncio.Event()
        self._pump()
        self._check_drained()
        await self._drained.wait()

    def fail_all(self, error: ServeError) -> None:
        """Resolve every queued request with `error` (the model went away)."""
        for item in self._queue.expire(float("inf")):
            _fail(item.payload, error)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._drained is not None and not len(self._queue) and not self._running:
            self._drained.set()


def _fail(request: PendingRequest, error: ServeError) -> None:
    if not request.future.done():
        request.future.set_exception(error)


__all__ = ["LANES", "ModelScheduler", "RequestResult", "WorkerLost"]
