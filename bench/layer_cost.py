"""Per-request cost of each observability layer, in microseconds, measured in-process.

Each layer is timed as servewell uses it on one request (and, for per-batch work, one batch
of 8 requests amortized): the request-context middleware around a trivial ASGI app (request
id, timing headers), plus the metrics it records, plus the spans when tracing samples 100%
(exported through the real BatchSpanProcessor to an exporter that encodes them as OTLP
protobuf and drops the bytes; the export thread's work is inside the measured time), plus one JSON
log line (written only for slow or failed requests). Median of repeated runs.

    python -m bench.layer_cost            # prints a table, writes bench/results/layer_cost.json
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from servewell.api.middleware import RequestContextMiddleware
from servewell.api.state import LiveKnobs
from servewell.observability.logging import JsonLineFormatter
from servewell.observability.metrics import ServeMetrics
from servewell.observability.otlp import encode_spans
from servewell.observability.tracing import DEFAULT_SAMPLE_RATIO, Link, Tracing, TracingSettings

RESULTS = Path(__file__).parent / "results"
REQUESTS = 3000
REPEATS = 7
BATCH = 8


class EncodeOnlyExporter(SpanExporter):
    """Encodes spans as servewell's OTLP/HTTP exporter does (protobuf), then drops them: the CPU
    of export is counted, a network's latency is not."""

    def export(self, spans):
        encode_spans(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def tracing_to_nowhere(ratio: float = 1.0) -> Tracing:
    """The frontend's tracing (its provider, resource, sampler and batch processor), exporting to
    `EncodeOnlyExporter`. The middleware decides root sampling (`sample_root`, at `ratio`)."""
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "200000")  # one repeat's spans, none dropped
    return Tracing(TracingSettings(None, "http/protobuf", ratio), decides_roots=True, exporter=EncodeOnlyExporter())


async def app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


def app_doing(*works):
    """A bare app that does the per-request `works` inside the request, as routes and the scheduler do."""
    async def handler(scope, receive, send) -> None:
        for work in works:
            work()
        await app(scope, receive, send)

    return handler


SCOPE = {"type": "http", "method": "POST", "path": "/v2/models/m/infer",
         "headers": [(b"content-type", b"application/json")]}


async def _drive(handler, n: int, tracing: Tracing | None) -> float:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        pass

    started = time.perf_counter()
    for _ in range(n):
        await handler(dict(SCOPE), receive, send)
    if tracing is not None:
        tracing.force_flush()  # the export of these spans is part of their cost
    return (time.perf_counter() - started) / n


def per_request_us(handler, tracing: Tracing | None = None) -> float:
    """Median µs per request of `handler` (with the export of its spans, when `tracing` is given)."""
    samples = [asyncio.run(_drive(handler, REQUESTS, tracing)) for _ in range(REPEATS)]
    return statistics.median(samples) * 1e6


def metrics_work(metrics: ServeMetrics):
    """What the route and the scheduler record per request, and per batch amortized."""
    pre, post = metrics.preprocess.labels("m"), metrics.postprocess.labels("m")
    wait, ok = metrics.queue_wait.labels("m", "normal"), metrics.requests.labels("m", "normal", "success")
    compute, transport = metrics.compute.labels("m"), metrics.transport.labels("m")
    size = metrics.batch_size.labels("m")
    counter = [0]

    def work() -> None:
        pre.observe(0.0004)
        post.observe(0.0001)
        wait.observe(0.002)
        ok.inc()
        counter[0] += 1
        if counter[0] % BATCH == 0:
            compute.observe(0.01)
            transport.observe(0.0003)
            size.observe(BATCH)

    return work


def tracing_work(tracing: Tracing):
    """The spans the route and scheduler make per request (preprocess, queue) and per batch, only
    for sampled requests, as servewell does."""
    tracer = tracing.tracer
    pending: list = []
    seen = [0]

    def work() -> None:
        current = trace.get_current_span()
        seen[0] += 1
        if current.is_recording():
            with tracer.start_as_current_span("preprocess"):
                pass
            now = time.time_ns()
            queue = tracer.start_span("queue", start_time=now)
            queue.end(end_time=now + 1000)
            pending.append(current.get_span_context())
        if seen[0] % BATCH == 0 and pending:
            batch = tracer.start_span("batch", links=[Link(c) for c in pending])
            batch.end()
            pending.clear()

    return work


def log_line_us() -> float:
    formatter = JsonLineFormatter()
    record = logging.LogRecord("servewell.api", logging.WARNING, __file__, 1, "slow request: %.1f ms", (412.0,), None)
    record.stages_ms = {"preprocess": 1.2, "queue": 300.0, "compute": 100.0, "postprocess": 0.3}
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(REQUESTS):
            formatter.format(record)
        samples.append((time.perf_counter() - started) / REQUESTS)
    return statistics.median(samples) * 1e6


#: The middleware's live settings: the default slow-request threshold, as a server starts with.
KNOBS = LiveKnobs(slow_request_s=0.3, metrics_need_key=False)


def main() -> int:
    metrics = ServeMetrics()
    tracing = tracing_to_nowhere()
    bare = per_request_us(app)
    context_only = per_request_us(RequestContextMiddleware(app, KNOBS))
    with_metrics = per_request_us(RequestContextMiddleware(app_doing(metrics_work(metrics)), KNOBS, metrics=metrics))
    traced = RequestContextMiddleware(app_doing(metrics_work(metrics), tracing_work(tracing)), KNOBS, metrics=metrics,
                                      tracing=tracing)
    with_tracing = per_request_us(traced, tracing)
    tracing.shutdown()
    default_tracing = tracing_to_nowhere(DEFAULT_SAMPLE_RATIO)
    default = RequestContextMiddleware(app_doing(metrics_work(metrics), tracing_work(default_tracing)), KNOBS,
                                       metrics=metrics, tracing=default_tracing)
    with_default = per_request_us(default, default_tracing)
    default_tracing.shutdown()
    rows = {
        "request context (id, timing headers)": context_only - bare,
        "metrics (request + stages + per-batch, amortized)": with_metrics - context_only,
        "tracing at 100% sampling (http, preprocess, queue, batch spans)": with_tracing - with_metrics,
        f"tracing at the default {DEFAULT_SAMPLE_RATIO:.0%} sampling": with_default - with_metrics,
        "one JSON log line (slow or failed requests only)": log_line_us(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "layer_cost.json").write_text(json.dumps({"us_per_request": rows, "bare_app_us": bare}, indent=2))
    print(f"{'layer':<68} {'µs/request':>10}")
    for name, value in rows.items():
        print(f"{name:<68} {value:>10.1f}")
    print(f"{'(bare ASGI app call, the baseline)':<68} {bare:>10.1f}")
    print("budget from the original design: under 300 µs per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
