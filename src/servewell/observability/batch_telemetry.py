"""Metrics and spans of one model's scheduler: per-request outcomes and queue waits, per-batch
compute (also by batch size), transport and size, the `queue`/`batch` spans, and each request's
`BatchPlacement` (batch id, batch size, instance, queue position) for its slow/failed record.

Metric children are bound to the model's labels once, so the hot path only observes. Spans are
made only for requests whose `http` span is recording: unsampled work costs nothing here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Tracer

from servewell.observability.context import BatchPlacement, placement_var, request_trace_var
from servewell.observability.metrics import OUTCOMES, ServeMetrics, batch_size_bucket

#: Batch ids: one counter for the whole process, so an id names one batch whatever the model or
#: version (a reloaded model gets a new scheduler, not new ids).
_BATCH_IDS = itertools.count(1)


@dataclass(slots=True, frozen=True)
class TraceMark:
    """What a queued request's telemetry carries: where its trace continues (its `http` span's
    context, None when not tracing), when it queued, and its placement record (None outside a
    request context)."""

    context: Context | None
    enqueued_ns: int
    placement: BatchPlacement | None = None


class BatchTelemetry:
    """Everything one model's scheduler records."""

    def __init__(self, model: str, version: str, lanes: Sequence[str], metrics: ServeMetrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self._model, self._version, self._lanes = model, version, tuple(lanes)
        self._tracer = tracer
        self._metrics = metrics
        if metrics is not None:
            self._compute = metrics.compute.labels(model)
            self._transport = metrics.transport.labels(model)
            self._batch_size = metrics.batch_size.labels(model)
            self._queue_wait = [metrics.queue_wait.labels(model, lane) for lane in self._lanes]
            self._outcome = [{o: metrics.requests.labels(model, lane, o) for o in OUTCOMES} for lane in self._lanes]

    # --- metrics -------------------------------------------------------------------------

    def count(self, lane: int, outcome: str, n: int = 1) -> None:
        """Count `n` requests of `lane` ending with `outcome` (one of `OUTCOMES`)."""
        if self._metrics is not None:
            self._outcome[lane][outcome].inc(n)

    def request_succeeded(self, lane: int, queue_s: float) -> None:
        """A request got its result after waiting `queue_s` in its lane."""
        if self._metrics is not None:
            self._queue_wait[lane].observe(queue_s)
            self._outcome[lane]["success"].inc()

    def batch_finished(self, rows: int, elapsed_s: float, compute_s: float,
                       steps: Sequence[tuple[str, float]] = ()) -> None:
        """A batch of `rows` came back after `elapsed_s`, of which the worker computed `compute_s`."""
        if self._metrics is not None:
            self._compute.observe(compute_s)
            # Per batch, not per request: one more labelled lookup is nothing here.
            self._metrics.compute_by_size.labels(self._model, str(batch_size_bucket(rows))).observe(compute_s)
            self._transport.observe(max(0.0, elapsed_s - compute_s))
            self._batch_size.observe(rows)
            for step, seconds in steps:
                self._metrics.trace_steps.labels(step).observe(seconds)

    # --- spans ---------------------------------------------------------------------------

    def mark(self, queue_position: int) -> TraceMark | None:
        """The current request's trace position and placement record, kept with it while it
        queues; `queue_position` (requests ahead of it in its lane) goes into the placement now.
        None when there is neither (not tracing, no request context)."""
        placement = placement_var.get()
        if placement is not None:
            placement.queue_position = queue_position
        if self._tracer is None:
            return None if placement is None else TraceMark(None, 0, placement)
        context = request_trace_var.get()
        return TraceMark(context if isinstance(context, Context) else otel_context.get_current(), time.time_ns(),
                         placement)

    def start_batch(self, marks: Sequence[tuple[TraceMark | None, int]], rows: int, instance: int) -> Span | None:
        """A batch of `rows` was formed for model instance `instance`: give it an id, write its
        facts into every request's placement, end each sampled request's `queue` span and start
        one `batch` span linked to all of them (child of the first, so parent-based sampling
        records it); None when none is sampled. `marks` pairs each request's mark with its lane."""
        batch_id = next(_BATCH_IDS)
        for mark, _ in marks:
            if mark is not None and mark.placement is not None:
                mark.placement.batch_id, mark.placement.batch_size = batch_id, rows
                mark.placement.instance = instance
        if self._tracer is None:
            return None
        now_ns = time.time_ns()
        links = []
        first: Context | None = None
        for mark, lane in marks:
            if mark is None or mark.context is None:
                continue
            parent = trace.get_current_span(mark.context)
            if not parent.get_span_context().trace_flags.sampled:
                continue  # unsampled (a request span here records; one from an ingress is remote and sampled)
            links.append(Link(parent.get_span_context()))
            first = first or mark.context
            queue = self._tracer.start_span(
                "queue", context=mark.context, start_time=mark.enqueued_ns,
                attributes={"servewell.model": self._model, "servewell.lane": self._lanes[lane]},
            )
            queue.end(end_time=now_ns)
        if not links:
            return None
        return self._tracer.start_span(
            "batch", context=first, links=links, start_time=now_ns,
            attributes={"servewell.model": self._model, "servewell.model_version": self._version,
                        "servewell.batch_size": rows, "servewell.requests": len(marks),
                        "servewell.batch.id": batch_id, "servewell.worker.instance": instance},
        )

    @staticmethod
    def end_batch(span: Span | None, failed: bool) -> None:
        """Close a `batch` span with its outcome."""
        if span is not None:
            span.set_attribute("servewell.outcome", "error" if failed else "success")
            span.end()
