"""Per-model scheduler: admits requests into priority lanes and feeds free workers batches.

Event-driven: it acts when a request arrives, when a worker becomes free, and on one timer
(the earliest of "a batching wait ends" and "a queued deadline passes"). It never polls.
The rules themselves live in `BatchQueue` (ordering, lanes, bounds) and `batch_policy`
(when to start); this class only wires them to the event loop and the workers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from servewell.config.model import BatchingConfig, ModelConfig
from servewell.engine.batch_policy import (
    ArrivalRate,
    BatchLatencyModel,
    BatchOpportunity,
    adaptive_wait,
    idle_wait,
    window_wait,
)
from servewell.engine.batch_queue import BatchQueue, QueuedItem
from servewell.errors import DeadlineExceeded, InvalidInput, ModelError, Overloaded, ServeError, ShuttingDown
from servewell.observability.context import request_trace_var
from servewell.observability.metrics import ServeMetrics
from servewell.observability.tracing import Link, traceparent_of


class _BoundMetrics:
    """Metric children bound to one model's labels once, so the hot path only observes."""

    def __init__(self, metrics: ServeMetrics, model: str, lanes: list[str]) -> None:
        self.compute = metrics.compute.labels(model)
        self.transport = metrics.transport.labels(model)
        self.batch_size = metrics.batch_size.labels(model)
        self.steps = metrics.trace_steps
        self.queue_wait = [metrics.queue_wait.labels(model, lane) for lane in lanes]
        self.outcome = [
            {o: metrics.requests.labels(model, lane, o) for o in ("success", "rejected", "deadline_exceeded",
                                                                   "cancelled", "error")}
            for lane in lanes
        ]


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
    item: QueuedItem | None = field(default=None, repr=False)
    trace_context: Context | None = None  # the request's span, when tracing
    enqueued_ns: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start, for health and benchmarks."""

    batches: int = 0
    rows: int = 0
    expired: int = 0
    cancelled: int = 0
    rejected: int = 0


class ModelScheduler:
    """Queues requests for one model and runs them in batches on its workers."""

    def __init__(self, config: ModelConfig, metrics: ServeMetrics | None = None, tracer: Tracer | None = None) -> None:
        self.config = config
        self._tracer = tracer
        self._metrics = _BoundMetrics(metrics, config.name, config.batching.lanes) if metrics else None
        self.batching: BatchingConfig = config.batching
        self.max_batch_size = max(1, config.max_batch_size)
        self.lanes: tuple[str, ...] = tuple(config.batching.lanes)
        self._queue: BatchQueue[PendingRequest] = BatchQueue(
            len(self.lanes), self.batching.max_queue_size, self.batching.max_consecutive_high
        )
        self._idle: list = []  # WorkerHandle-like: .alive, async .run(parts)
        self._reserved = None  # the instance kept for the first lane, when configured
        self._reserved_free = False
        self._workers = 0
        self._running = 0
        self._running_requests = 0
        self._timer: asyncio.TimerHandle | None = None
        self._accepting = True
        self._drained: asyncio.Event | None = None
        self._latency = BatchLatencyModel()
        self._arrivals = ArrivalRate()
        self.stats = SchedulerStats()

    # --- settings ------------------------------------------------------------------------

    def update(self, changes: dict[str, Any]) -> BatchingConfig:
        """Change batching settings (and `max_batch_size`) while serving; nothing queued is lost.

        `max_batch_size` may not exceed the model's configured value (the size it warmed up
        with); lanes are fixed at load time.
        """
        changes = dict(changes)
        if "max_batch_size" in changes:
            size = changes.pop("max_batch_size")
            ceiling = max(1, self.config.max_batch_size)
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= ceiling:
                raise InvalidInput(f"max_batch_size must be an integer from 1 to {ceiling} (the configured maximum)")
            self.max_batch_size = size
        if "lanes" in changes:
            raise InvalidInput("lanes are fixed while the model is loaded; change model.yaml and reload")
        merged = {**self.batching.model_dump(), **changes}
        try:
            updated = BatchingConfig.model_validate(merged)
        except ValueError as exc:
            raise InvalidInput(f"invalid batching settings: {exc}") from None
        if updated.reserve_instance_for_high and self.config.instances < 2:
            raise InvalidInput("reserve_instance_for_high needs instances >= 2")
        self.batching = updated
        self._queue.max_queue_size = updated.max_queue_size
        self._queue.max_consecutive_high = updated.max_consecutive_high
        if not updated.reserve_instance_for_high and self._reserved is not None:
            if self._reserved_free:
                self._idle.append(self._reserved)
            self._reserved, self._reserved_free = None, False
        self._pump()
        return updated

    def settings(self) -> dict[str, Any]:
        """Current live settings."""
        return {"max_batch_size": self.max_batch_size, **self.batching.model_dump()}

    # --- workers -------------------------------------------------------------------------

    def add_worker(self, worker) -> None:  # noqa: ANN001 - WorkerHandle
        """Make a ready worker available for batches."""
        self._workers += 1
        self._release(worker)

    def remove_worker(self, worker) -> None:  # noqa: ANN001
        """Forget a worker (it died or is being stopped)."""
        self._workers = max(0, self._workers - 1)
        if worker in self._idle:
            self._idle.remove(worker)
        if worker is self._reserved:
            self._reserved, self._reserved_free = None, False

    def _release(self, worker) -> None:  # noqa: ANN001
        self._return_worker(worker)
        self._pump()

    def _return_worker(self, worker) -> None:  # noqa: ANN001
        if getattr(worker, "retiring", False):
            return  # being drained and replaced: no new batches
        if self.batching.reserve_instance_for_high and self._reserved is None and self._workers >= 2:
            self._reserved = worker
        if worker is self._reserved:
            self._reserved_free = True
        else:
            self._idle.append(worker)

    # --- requests ------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting, all lanes together."""
        return len(self._queue)

    def lane_depths(self) -> dict[str, int]:
        """Requests waiting per lane."""
        return {name: self._queue.depth(i) for i, name in enumerate(self.lanes)}

    @property
    def running_rows(self) -> int:
        """Requests inside batches on workers right now."""
        return self._running_requests

    def lane_index(self, lane: str | None) -> int:
        """Index of a lane name; unknown or None means 'normal' (or the lowest lane)."""
        if lane in self.lanes:
            return self.lanes.index(lane)
        return self.lanes.index("normal") if "normal" in self.lanes else len(self.lanes) - 1

    def admit(self, lane: str | None) -> None:
        """Refuse at once (`Overloaded`, `ShuttingDown`) what `submit` would refuse, before the
        caller spends anything on decoding the request."""
        lane_index = self.lane_index(lane)
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        if self._queue.depth(lane_index) >= self._queue.max_queue_size:
            raise self._refuse(lane_index)

    def _refuse(self, lane_index: int) -> Overloaded:
        """Count a refusal of a full lane and build its error, Retry-After from the predicted drain."""
        self.stats.rejected += 1
        self._count(lane_index, "rejected")
        return Overloaded(
            f"model '{self.config.name}' has {self._queue.depth(lane_index)} requests queued in lane "
            f"'{self.lanes[lane_index]}', its limit",
            retry_after_s=self._predicted_drain_s(),
        )

    def submit(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        lane: str | None,
        timeout_ms: float | None,
        request_id: str,
        arrived_at: float | None = None,
    ) -> asyncio.Future[RequestResult]:
        """Queue a request; its future resolves with the result or a `ServeError`.

        The deadline counts from `arrived_at` (loop time when the request reached the server;
        default now), so decoding time is part of it. Raises `Overloaded` at once when the lane is
        full, `ShuttingDown` while draining, `DeadlineExceeded` when the deadline has already
        passed. Cancelling the future (the client went away) drops the request before compute.
        """
        lane_index = self.lane_index(lane)
        if not self._accepting:
            self._count(lane_index, "rejected")
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        if rows > self.max_batch_size and self.config.max_batch_size > 0:
            raise InvalidInput(f"a batch of {rows} exceeds the current max_batch_size {self.max_batch_size}")
        loop = asyncio.get_running_loop()
        now = loop.time()
        timeout_s = (timeout_ms if timeout_ms is not None else self.batching.default_timeout_ms) / 1000.0
        deadline_at = (arrived_at if arrived_at is not None else now) + timeout_s
        if deadline_at <= now:
            self.stats.expired += 1
            self._count(lane_index, "deadline_exceeded")
            raise DeadlineExceeded(f"the request's deadline of {timeout_s * 1000:.0f} ms passed before it was queued")
        future: asyncio.Future[RequestResult] = loop.create_future()
        pending = PendingRequest(inputs, request_id, future, now)
        if self._tracer is not None:
            pending.trace_context = request_trace_var.get() or otel_context.get_current()
            pending.enqueued_ns = time.time_ns()
        shape_key = tuple((name, a.shape[1:], a.dtype.str) for name, a in inputs.items())
        item = QueuedItem(pending, lane_index, rows, shape_key, deadline_at, now)
        if not self._queue.push(item):
            raise self._refuse(lane_index)
        self._arrivals.observe(now)
        pending.item = item
        future.add_done_callback(lambda f, it=item: f.cancelled() and self._on_cancel(it))
        self._pump()
        return future

    def _count(self, lane: int, outcome: str, n: int = 1) -> None:
        if self._metrics is not None:
            self._metrics.outcome[lane][outcome].inc(n)

    def _on_cancel(self, item: QueuedItem) -> None:
        if item.queued:
            self.stats.cancelled += 1
            self._count(item.lane, "cancelled")
        self._queue.cancel(item)
        self._check_drained()

    # --- the pump ------------------------------------------------------------------------

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for item in self._queue.expire(now):
            self.stats.expired += 1
            self._count(item.lane, "deadline_exceeded")
            _fail(item.payload, DeadlineExceeded(
                f"the request waited {1000 * (now - item.enqueued_at):.0f} ms in the queue and passed its deadline "
                "before the model could run it"
            ))
        wake_at: float | None = None
        while len(self._queue):
            lane = self._queue.next_lane()
            if lane is None:
                break
            worker = self._pick_worker(lane)
            if worker is None and lane != 0 and self._queue.depth(0):
                lane = 0  # only the reserved instance is free, and urgent work waits
                worker = self._pick_worker(lane)
            if worker is None:
                break
            head = self._queue.head(lane)
            wait_until = self._wait_until(lane, head, now) if head is not None else None
            if wait_until is not None:
                wake_at = wait_until
                self._return_worker(worker)
                break
            batch = self._viable(self._queue.take_batch(self.max_batch_size, lane), now)
            if not batch:
                self._return_worker(worker)
                continue
            self._running += 1
            self._running_requests += len(batch)
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

    def _viable(self, items: list[QueuedItem], now: float) -> list[PendingRequest]:
        """Drop from a batch what nobody waits for any more, and what could only finish after its
        deadline (by the learned batch latency): an answer nobody can use costs compute others need."""
        finish_at = now + self._latency.predict(sum(i.rows for i in items)) if self._latency.observed else now
        batch = []
        for item in items:
            if item.payload.future.done():
                continue
            if item.deadline_at < finish_at:
                self.stats.expired += 1
                self._count(item.lane, "deadline_exceeded")
                _fail(item.payload, DeadlineExceeded(
                    f"the request would finish after its deadline (it waited {1000 * (now - item.enqueued_at):.0f} ms, "
                    f"the batch takes about {1000 * (finish_at - now):.0f} ms); it was not run"
                ))
                continue
            batch.append(item.payload)
        return batch

    def _pick_worker(self, lane: int):  # noqa: ANN202
        """A free worker for a batch of `lane`: the reserved one serves only the first lane."""
        if lane == 0 and self._reserved is not None and self._reserved_free and self._reserved.alive:
            self._reserved_free = False
            return self._reserved
        if self._idle:
            return self._idle.pop()
        return None

    def _wait_until(self, lane: int, head: QueuedItem, now: float) -> float | None:
        """When a batch of `lane` led by `head` must start; None means now."""
        if lane == 0 or not self._accepting:
            return None  # the first lane never waits; a draining server flushes
        oldest = self._queue.oldest_enqueued_at(lane)
        op = BatchOpportunity(
            now, oldest if oldest is not None else head.enqueued_at,
            self._queue.ready_rows(lane, head.shape_key), self.max_batch_size, max(1, self._workers),
        )
        policy = self.batching.policy
        if policy == "window":
            return window_wait(op, self.batching.max_wait_ms / 1000.0)
        if policy == "adaptive":
            return adaptive_wait(op, self._latency, self._arrivals, self.batching.latency_slo_ms / 1000.0,
                                 self.batching.max_wait_ms / 1000.0)
        return idle_wait(op)

    async def _execute(self, worker, batch: list[PendingRequest]) -> None:  # noqa: ANN001
        loop = asyncio.get_running_loop()
        started = loop.time()
        names = [spec.name for spec in self.config.inputs]
        rows = sum(r.item.rows for r in batch)
        span = self._start_batch_span(batch, rows) if self._tracer is not None else None
        try:
            outcome = await worker.run(
                {name: [r.inputs[name] for r in batch] for name in names},
                traceparent_of(span.get_span_context()) if span is not None else None,
            )
            results = self._split(outcome.outputs, batch)
        except ServeError as exc:
            for request in batch:
                self._count(request.item.lane, "error")
                _fail(request, exc)
        except Exception as exc:  # a bug in our splitting or transport must still resolve every future
            for request in batch:
                self._count(request.item.lane, "error")
                _fail(request, ModelError(f"batch failed: {exc}"))
        else:
            elapsed = loop.time() - started
            self._latency.observe(rows, elapsed)
            self.stats.batches += 1
            self.stats.rows += rows
            m = self._metrics
            if m is not None:
                m.compute.observe(outcome.compute_s)
                m.transport.observe(max(0.0, elapsed - outcome.compute_s))
                m.batch_size.observe(rows)
                for step, seconds in outcome.steps:
                    m.steps.labels(step).observe(seconds)
            for request, outputs in zip(batch, results):
                lane = request.item.lane
                if request.future.done():  # the client went away while the batch ran
                    self._count(lane, "cancelled")
                    continue
                queue_s = started - request.enqueued_at
                if m is not None:
                    m.queue_wait[lane].observe(queue_s)
                    m.outcome[lane]["success"].inc()
                request.future.set_result(RequestResult(outputs, queue_s, outcome.compute_s, rows))
        finally:
            if span is not None:
                failed = any(r.future.done() and not r.future.cancelled() and r.future.exception() for r in batch)
                span.set_attribute("servewell.outcome", "error" if failed else "success")
                span.end()
            self._running -= 1
            self._running_requests -= len(batch)
            if worker.alive:
                self._return_worker(worker)
            self._pump()

    def _start_batch_span(self, batch: list[PendingRequest], rows: int):  # noqa: ANN202 - Span | None
        """One `batch` span linking every sampled request span, and each sampled request's `queue`
        span ended now; None when no request in the batch is sampled (unsampled work costs nothing)."""
        now_ns = time.time_ns()
        links = []
        first_sampled: Context | None = None
        for request in batch:
            if request.trace_context is None:
                continue
            parent = trace.get_current_span(request.trace_context)
            if not parent.is_recording():
                continue
            links.append(Link(parent.get_span_context()))
            first_sampled = first_sampled or request.trace_context
            queue = self._tracer.start_span(
                "queue", context=request.trace_context, start_time=request.enqueued_ns,
                attributes={"servewell.model": self.config.name, "servewell.lane": self.lanes[request.item.lane]},
            )
            queue.end(end_time=now_ns)
        if not links:
            return None
        # Under the first sampled request (so parent-based sampling records it), linked to all of them.
        return self._tracer.start_span(
            "batch", context=first_sampled, links=links,
            start_time=now_ns,
            attributes={"servewell.model": self.config.name, "servewell.model_version": self.config.version,
                        "servewell.batch_size": rows, "servewell.requests": len(batch)},
        )

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
        """Seconds until the queue would drain at the learned batch latency."""
        per_batch = self._latency.predict(self.max_batch_size) if self._latency.observed else 0.05
        batches = len(self._queue) / self.max_batch_size / max(1, self._workers)
        return max(1.0, batches * per_batch)

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
