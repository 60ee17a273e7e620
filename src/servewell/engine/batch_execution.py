"""Running one model's batches once they are handed to a runner, to their end.

A batch's rows go to the worker first; then a task follows it: a `BatchWatch` answers its requests
at their deadlines and declares the runner hung past its compute budget, the outputs are split
per request and delivered, a batch the model failed runs again one request at a time (so only the
requests the model itself fails on get `model_error`), and every request is answered whatever
happens: success, a deadline, a hung or lost worker, a bug in transport. The scheduler
(engine/scheduler.py) decides what runs where and when; this runs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np
from opentelemetry.trace import Span

from servewell.config.model import ModelConfig
from servewell.engine.batch_policy import LearnedLoad
from servewell.engine.batch_runner import BatchOutcome, BatchRunner, split_rows
from servewell.engine.batch_watch import BatchWatch
from servewell.engine.clock import Clock, precise_time
from servewell.engine.protocol import RequestResult
from servewell.engine.scheduled import Request, SchedulerStats, fail, failed
from servewell.errors import ModelError, ServeError, WorkerHung
from servewell.observability.batch_telemetry import BatchTelemetry
from servewell.observability.tracing import traceparent_of

log = logging.getLogger("servewell.engine")


class BatchExecution:
    """Follows one model's batches from hand-over to their end (the scheduler owns one)."""

    def __init__(self, config: ModelConfig, telemetry: BatchTelemetry, clock: Clock, learned: LearnedLoad,
                 stats: SchedulerStats, expire: Callable[[Request, str], None],
                 compute_budget_s: Callable[[int], float], ended: Callable[[BatchRunner, int], None]) -> None:
        self.config = config
        self._telemetry = telemetry
        self._clock = clock
        self._precise = precise_time(clock)
        self._learned = learned
        self.stats = stats
        self._expire = expire  # answer a request 503 deadline_exceeded, counted (the scheduler's rule)
        self._compute_budget_s = compute_budget_s
        self._ended = ended  # the batch (runner, serial) is over: free the runner, pump again

    def start(self, runner: BatchRunner, serial: int, batch: list[Request], started: float) -> None:
        """Hand `batch` to `runner` now, then follow it in a task: the rows go to the worker first and
        the bookkeeping (the task, its watch) runs while the worker computes."""
        rows = sum(item.rows for item in batch)
        handed_at = self._precise()
        for item in batch:
            item.payload.queue_s = handed_at - item.payload.queued_at
        span = self._telemetry.start_batch([(item.payload.trace, item.lane) for item in batch], rows, runner.instance)
        running = self._hand_over(runner, batch, span)
        asyncio.get_running_loop().create_task(self._execute(runner, serial, batch, span, started, running))

    def _hand_over(self, runner: BatchRunner, batch: list[Request], span: Span | None) -> asyncio.Future[BatchOutcome]:
        """`runner.send_batch` the batch; a runner that refuses it at once gives a failed future."""
        try:
            return runner.send_batch(
                {spec.name: [item.payload.request.inputs[spec.name] for item in batch] for spec in self.config.inputs},
                traceparent_of(span.get_span_context()) if span is not None else None,
                [item.deadline_at for item in batch],
            )
        except Exception as exc:  # a bug in transport must still resolve every future (`_run_watched`)
            refused: asyncio.Future[BatchOutcome] = asyncio.get_running_loop().create_future()
            refused.set_exception(exc)
            return refused

    async def _execute(self, runner: BatchRunner, serial: int, batch: list[Request], span: Span | None,
                       started: float, running: asyncio.Future[BatchOutcome]) -> None:
        try:
            error = await self._run_watched(runner, batch, span, started, running)
            if error is None:
                # The answered requests' waiters (a pipeline's next step, the door's answer) were
                # woken by the results: let them run before this batch's bookkeeping, which is
                # nobody's latency (at low load, a pipeline step starts that much sooner).
                await asyncio.sleep(0)
            still_open = [item for item in batch if not item.payload.future.done()]
            if isinstance(error, ModelError) and len(still_open) > 1 and runner.alive:
                # One bad input must not fail its batch-mates: each request runs again alone,
                # once, so only those the model itself fails on get model_error. Costs a run per
                # request, only for batches that failed (a model failing on everything pays ~2x).
                log.warning("model %s: a batch of %d requests failed (%s); running each alone",
                            self.config.name, len(still_open), error, extra={"model": self.config.name})
                self.stats.isolated_batches += 1
                for item in still_open:
                    if item.payload.future.done():
                        continue
                    if runner.alive:
                        alone = self._clock.now()
                        error = await self._run_watched(runner, [item], span, alone,
                                                        self._hand_over(runner, [item], span))
                    self._fail_open([item], error)
            else:
                self._fail_open(batch, error)
        finally:
            self._telemetry.end_batch(span, any(failed(item) for item in batch))
            self._ended(runner, serial)

    def _fail_open(self, items: list[Request], error: ServeError | None) -> None:
        """Answer `error` to every item still waiting (none: the run succeeded)."""
        if error is None:
            return
        for item in items:
            if not item.payload.future.done():  # answered already: at its deadline, or cancelled
                self._telemetry.count(item.lane, "error")
                fail(item, error)

    async def _run_watched(self, runner: BatchRunner, batch: list[Request], span: Span | None, started: float,
                           running: asyncio.Future[BatchOutcome]) -> ServeError | None:
        """Wait for `batch`, handed to `runner` at `started` (`running`), under a `BatchWatch`
        (deadlines, compute budget) and deliver its results; the error it failed with, else None."""
        rows = sum(item.rows for item in batch)
        budget_s = self._compute_budget_s(rows)

        def expire(item: Request, now: float) -> None:
            self._expire(item, f"the request passed its deadline while its batch was running "
                               f"({1000 * (now - started):.0f} ms so far)")

        def overrun(now: float) -> None:
            why = f"a batch of {rows} has run {now - started:.1f} s, over its compute budget of {budget_s:.1f} s"
            log.error("model %s: %s; its worker is declared hung", self.config.name, why,
                      extra={"model": self.config.name})
            self._fail_open(batch, WorkerHung(f"{why}; the worker is being replaced, retry"))
            runner.declare_hung(why)

        watch: BatchWatch[Request] | None = None
        try:
            watch = BatchWatch(self._clock, [(item.deadline_at, item) for item in batch], started + budget_s,
                               lambda item: not item.payload.future.done(), expire, overrun)
            outcome = await running
            skipped = set(outcome.skipped)
            ran = [item for i, item in enumerate(batch) if i not in skipped]
            results = split_rows(outcome.outputs, [item.rows for item in ran],
                                 self.config.max_batch_size > 0) if ran else []
        except Exception as exc:  # a bug in splitting or transport must still resolve every future
            return exc if isinstance(exc, ServeError) else ModelError(f"batch failed: {exc}")
        else:
            for i in sorted(skipped):
                if 0 <= i < len(batch) and not batch[i].payload.future.done():
                    self._expire(batch[i], "the request's deadline passed before its worker could start the batch; "
                                           "it was not run")
            if ran:
                self._deliver(ran, results, outcome, started, sum(item.rows for item in ran))
            return None
        finally:
            if watch is not None:
                watch.stop()

    def _deliver(self, batch: list[Request], results: list[dict[str, np.ndarray]], outcome: BatchOutcome,
                 started: float, rows: int) -> None:
        elapsed = self._clock.now() - started
        self._learned.latency.observe(rows, elapsed)
        self.stats.batches += 1
        self.stats.rows += rows
        self._telemetry.batch_finished(rows, elapsed, outcome.compute_s, outcome.steps)
        for item, outputs in zip(batch, results, strict=True):
            future = item.payload.future
            if future.done():  # answered already: the client went away, or its deadline passed
                if future.cancelled():
                    self._telemetry.count(item.lane, "cancelled")
                continue
            queue_s = item.payload.queue_s
            self._telemetry.request_succeeded(item.lane, queue_s)
            future.set_result(RequestResult(outputs, queue_s, outcome.compute_s, rows, version=self.config.version))
