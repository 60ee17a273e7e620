"""What the live console costs the server, measured in-process.

- the request path: the request-context middleware around a bare ASGI app, without and with the
  console's ring buffer attached, for fast successes (which the ring never sees) and for failed
  requests (which it records, next to the log line they already cost);
- one sampling tick of the chart series (read every family the charts use and append a point per
  model), on a registry holding a busy server's series: 4 models x 2 lanes x every outcome, HTTP and
  gRPC routes, every status class; the sampler runs every 2 s;
- one `/console/api/state` series document (a full 5-minute window) encoded with orjson;
- the memory of a full window and of a full ring (tracemalloc).

Medians of repeated runs; the middleware rows alternate the two configurations in each round so the
machine's noise hits both alike.

    python -m bench.console_cost    # prints a table, writes bench/results/console_cost.json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import tracemalloc
from pathlib import Path

import orjson

from servewell.api.errors import error_response
from servewell.api.middleware import RequestContextMiddleware
from servewell.api.state import LiveKnobs
from servewell.observability.console_feed import ConsoleFeed
from servewell.observability.metrics import OUTCOMES, ServeMetrics
from servewell.observability.recent_requests import RecentRequests, RequestRecord

RESULTS = Path(__file__).parent / "results"
REQUESTS = 3000
REPEATS = 7
MODELS = ("m0", "m1", "m2", "m3")
ROUTES = ("/predict", "/v2/models/{name}/infer", "grpc ModelInfer")
SCOPE = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": []}


async def ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def failing_app(scope, receive, send) -> None:
    await error_response(503, "overloaded", "the lane is full")(scope, receive, send)


async def _drive(handler, n: int) -> float:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        pass

    started = time.perf_counter()
    for _ in range(n):
        await handler(dict(SCOPE), receive, send)
    return (time.perf_counter() - started) / n


def paired_us(without, with_ring) -> tuple[float, float]:
    """Median µs per request of two handlers, alternated round by round."""
    a, b = [], []
    for _ in range(REPEATS):
        a.append(asyncio.run(_drive(without, REQUESTS)))
        b.append(asyncio.run(_drive(with_ring, REQUESTS)))
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def busy_metrics() -> ServeMetrics:
    """A registry with every series a busy 4-model server has."""
    metrics = ServeMetrics()
    for model in MODELS:
        for lane in ("high", "normal"):
            metrics.queue_wait.labels(model, lane).observe(0.002)
            for outcome in OUTCOMES:
                metrics.count(model, lane, outcome)
        for route in ROUTES:
            for status in (200, 400, 503):
                metrics.observe_request(model, route, status, 0.01)
        metrics.observe_request(model, "/v2/models/{name}", 200, 0.001)
        metrics.compute.labels(model).observe(0.005)
        metrics.batch_size.labels(model).observe(4)
    metrics.observe_request("-", "unmatched", 404, 0.001)
    return metrics


def sample_us(feed: ConsoleFeed, metrics: ServeMetrics, n: int = 200) -> float:
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(n):
            metrics.count("m0", "normal", "success")  # something changes between ticks
            feed.sample()
        samples.append((time.perf_counter() - started) / n)
    return statistics.median(samples) * 1e6


def main() -> int:
    knobs = LiveKnobs(slow_request_s=10.0, metrics_need_key=False)
    ok_plain, ok_ring = paired_us(RequestContextMiddleware(ok_app, knobs),
                                  RequestContextMiddleware(ok_app, knobs, recent=RecentRequests()))
    fail_plain, fail_ring = paired_us(RequestContextMiddleware(failing_app, knobs),
                                      RequestContextMiddleware(failing_app, knobs, recent=RecentRequests()))

    metrics = busy_metrics()
    feed = ConsoleFeed(metrics)
    tick_us = sample_us(feed, metrics)  # also fills the window: 5 series x 150 points
    points = len(feed.series()["columns"]["t"])
    started = time.perf_counter()
    for _ in range(200):
        body = orjson.dumps(feed.series())
    document_us = (time.perf_counter() - started) / 200 * 1e6

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    full = ConsoleFeed(busy_metrics(), interval_s=2.0, window_s=300.0)
    for _ in range(160):
        full.sample()
    for i in range(250):
        full.recent.record(RequestRecord(f"{i:032x}", "http", "/v2/models/{name}/infer", "m0", 503, "overloaded",
                                         12.5, False, {"preprocess": 0.4, "queue": 11.0}))
    memory_kb = (tracemalloc.get_traced_memory()[0] - before) / 1024
    tracemalloc.stop()

    rows = {
        "fast success, middleware without the ring (µs/request)": ok_plain,
        "fast success, middleware with the ring (µs/request)": ok_ring,
        "failed request, without the ring (µs/request)": fail_plain,
        "failed request, with the ring: records it (µs/request)": fail_ring,
        "one sampling tick, 4 models (µs, every 2 s)": tick_us,
        "CPU share of one core for sampling (%)": tick_us / 2e6 * 100,
        f"series document, {points} points (µs per poll, {len(body)} bytes)": document_us,
        "full window (5 series x 150 points) + full ring (200) (KiB)": memory_kb,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "console_cost.json").write_text(json.dumps(rows, indent=2))
    width = max(len(k) for k in rows)
    for name, value in rows.items():
        print(f"{name:<{width}} {value:>10.2f}")
    print(f"ring on a fast success: {ok_ring / ok_plain:.3f}x of without (same run, alternated rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
