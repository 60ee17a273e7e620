"""The console's time series: rates and percentiles from metric deltas, bounded memory."""

import asyncio
import math

import pytest

from servewell.observability.console_feed import (
    ALL_MODELS,
    COLUMNS,
    ConsoleFeed,
    HistogramReading,
    counter_increase,
    is_inference_route,
    quantile,
)
from servewell.observability.metrics import ServeMetrics

BOUNDS = (0.01, 0.1, 1.0)


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    # 10 observations <= 0.01, 10 more in (0.01, 0.1], none above.
    cumulative = [10, 20, 20, 20]
    assert quantile(BOUNDS, cumulative, 0.5) == pytest.approx(0.01)  # the 10th of 20: top of the first bucket
    assert quantile(BOUNDS, cumulative, 0.25) == pytest.approx(0.005)  # halfway into the first, from 0
    assert quantile(BOUNDS, cumulative, 0.75) == pytest.approx(0.055)  # halfway into (0.01, 0.1]
    assert quantile(BOUNDS, cumulative, 0.99) == pytest.approx(0.01 + 0.09 * 9.8 / 10)


def test_quantile_edges():
    assert quantile(BOUNDS, [0, 0, 0, 0], 0.5) is None  # nothing observed
    assert quantile(BOUNDS, [0, 0, 0, 4], 0.99) == 1.0  # all above the last bound: the last bound
    assert quantile(BOUNDS, [0, 0, 4, 4], 0.5) == pytest.approx(0.55)  # empty buckets before are skipped
    with pytest.raises(ValueError):
        quantile(BOUNDS, [1, 2, 3], 0.5)


def test_counter_increase_survives_a_reset():
    assert counter_increase(15, 10) == 5
    assert counter_increase(3, 10) == 3  # went down: the series started again
    assert counter_increase(7, None) == 7  # new series


def test_histogram_window_subtracts_the_earlier_reading():
    before = HistogramReading([1, 2, 2, 3], 1.5)
    after = HistogramReading([4, 6, 7, 9], 4.0)
    delta = after.since(before)
    assert delta.cumulative == [3, 4, 5, 6] and delta.total == pytest.approx(2.5) and delta.count == 6
    assert after.since(None) is after
    assert before.since(after) is before  # fewer than before: a reset, so all of it is new


def test_inference_routes():
    assert is_inference_route("/predict") and is_inference_route("/v2/models/{name}/infer")
    assert is_inference_route("/v2/models/{name}/versions/{version}/infer") and is_inference_route("grpc ModelInfer")
    assert not is_inference_route("/v2/models/{name}") and not is_inference_route("grpc ModelMetadata")


class Clocks:
    def __init__(self) -> None:
        self.now = 100.0

    def mono(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now


def _column(feed: ConsoleFeed, name: str, model: str = ALL_MODELS) -> list:
    return feed.series(model)["columns"][name]


def test_sampling_turns_cumulative_metrics_into_rates_and_percentiles():
    metrics = ServeMetrics(latency_buckets=BOUNDS)
    clocks = Clocks()
    feed = ConsoleFeed(metrics, interval_s=2.0, window_s=10.0, clock=clocks.mono, wall_clock=clocks.wall)
    for _ in range(4):  # before the first reading: history, never charted as one burst
        metrics.count("a", "normal", "success")
    feed.sample()
    assert feed.series()["columns"]["t"] == []

    clocks.now += 2.0
    for _ in range(8):
        metrics.count("a", "normal", "success")
        metrics.observe_request("a", "/predict", 200, 0.005)
    for _ in range(2):
        metrics.count("b", "high", "rejected")
        metrics.observe_request("b", "/v2/models/{name}/infer", 503, 0.5)
    metrics.observe_request("a", "/v2/models/{name}", 200, 0.9)  # metadata: not in the latency chart
    metrics.observe_request("-", "/console/api/state", 200, 0.9)  # no model: counted nowhere
    metrics.queue_wait.labels("a", "normal").observe(0.002)
    metrics.compute.labels("a").observe(0.05)
    metrics.batch_size.labels("a").observe(4)
    metrics.batch_size.labels("a").observe(2)
    feed.sample()

    assert feed.models() == [ALL_MODELS, "a", "b"]
    assert _column(feed, "t") == [pytest.approx(1_700_000_102.0)]
    assert _column(feed, "success") == [4.0] and _column(feed, "rejected") == [1.0]  # 8 and 2 over 2 s
    assert _column(feed, "success", "a") == [4.0] and _column(feed, "rejected", "a") == [0.0]
    assert _column(feed, "rejected", "b") == [1.0]
    # 10 inference requests: 8 in (0, 0.01], 2 in (0.1, 1]: p50 inside the first bucket, p99 in the third.
    assert _column(feed, "latency_p50_ms") == [pytest.approx(6.25)]
    assert 100 < _column(feed, "latency_p99_ms")[0] <= 1000
    assert _column(feed, "latency_p99_ms", "a") == [pytest.approx(9.9)]  # the 0.9 s metadata call is left out
    assert _column(feed, "queue_p50_ms", "a") == [pytest.approx(5.0)]
    assert _column(feed, "compute_p50_ms", "a") == [pytest.approx(55.0)]
    assert _column(feed, "batch_mean", "a") == [3.0] and _column(feed, "batches_per_s", "a") == [1.0]
    assert _column(feed, "batch_mean", "b") == [None] and _column(feed, "compute_p99_ms", "b") == [None]

    clocks.now += 4.0  # nothing happened: rates 0, percentiles unknown
    feed.sample()
    assert _column(feed, "success") == [4.0, 0.0]
    assert _column(feed, "latency_p50_ms") == [pytest.approx(6.25), None]
    assert _column(feed, "batch_mean", "a")[-1] is None and _column(feed, "batches_per_s", "a")[-1] == 0.0


def test_the_window_and_the_number_of_models_are_bounded():
    metrics = ServeMetrics()
    clocks = Clocks()
    feed = ConsoleFeed(metrics, interval_s=1.0, window_s=5.0, max_models=2, clock=clocks.mono, wall_clock=clocks.wall)
    for _ in range(12):
        for model in ("m1", "m2", "m3", "m4"):
            metrics.count(model, "normal", "success")
        clocks.now += 1.0
        feed.sample()
    assert len(_column(feed, "t")) == 5  # 5 s of 1 s points
    assert _column(feed, "t")[-1] == pytest.approx(clocks.wall())
    assert feed.models() == [ALL_MODELS, "m1", "m2"]  # two (seen together: by name), and all models always
    assert _column(feed, "success") == [4.0] * 5  # the total still counts every model
    assert feed.series("m3")["columns"]["t"] == []


def test_compute_by_batch_size_covers_the_last_one_to_two_minutes():
    metrics = ServeMetrics(latency_buckets=BOUNDS)
    clocks = Clocks()
    feed = ConsoleFeed(metrics, interval_s=2.0, window_s=10.0, clock=clocks.mono, wall_clock=clocks.wall)
    by_size = metrics.compute_by_size
    by_size.labels("a", "1").observe(0.5)  # before the first reading, which is the first baseline: left out
    feed.sample()
    for _ in range(9):
        by_size.labels("a", "1").observe(0.005)
    by_size.labels("a", "8").observe(0.05)
    by_size.labels("b", "2").observe(0.05)
    assert feed.compute_by_batch_size("a") == [
        {"batch_size": 1, "count": 9, "p50_ms": pytest.approx(5.0), "p99_ms": pytest.approx(9.9)},
        {"batch_size": 8, "count": 1, "p50_ms": pytest.approx(55.0), "p99_ms": pytest.approx(99.1)},
    ]
    clocks.now += 61.0
    feed.sample()  # a second baseline; the view still counts from the first
    assert [row["count"] for row in feed.compute_by_batch_size("a")] == [9, 1]
    clocks.now += 61.0
    feed.sample()  # the first ages out: what ran before the second baseline is left out
    by_size.labels("a", "8").observe(0.05)
    assert feed.compute_by_batch_size("a") == [
        {"batch_size": 8, "count": 1, "p50_ms": pytest.approx(55.0), "p99_ms": pytest.approx(99.1)}]
    assert feed.compute_by_batch_size("nope") == [] and ConsoleFeed(None).compute_by_batch_size("a") == []


def test_series_shape_and_metrics_turned_off():
    feed = ConsoleFeed(None)
    feed.sample()
    doc = feed.series()
    assert doc["enabled"] is False and list(doc["columns"]) == list(COLUMNS)
    assert all(values == [] for values in doc["columns"].values())
    with pytest.raises(ValueError):
        ConsoleFeed(None, interval_s=0)


def test_run_samples_on_a_timer_and_stops_when_cancelled():
    metrics = ServeMetrics()
    feed = ConsoleFeed(metrics, interval_s=0.01, window_s=1.0)

    async def main() -> None:
        task = asyncio.create_task(feed.run())
        for _ in range(3):
            metrics.count("m", "normal", "success")
            await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    rates = _column(feed, "success", "m")
    assert len(rates) >= 2 and math.fsum(r for r in rates if r) > 0


def test_4xx_answers_count_as_client_errors_without_the_cancelled_ones():
    metrics = ServeMetrics(latency_buckets=BOUNDS)
    clocks = Clocks()
    feed = ConsoleFeed(metrics, interval_s=2.0, window_s=10.0, clock=clocks.mono, wall_clock=clocks.wall)
    feed.sample()
    clocks.now += 2.0
    for _ in range(6):  # bad input: the scheduler never saw them, so no model outcome counts them
        metrics.observe_request("a", "/v2/models/{name}/infer", 422, 0.001)
    metrics.count("a", "normal", "cancelled")  # a cancel is answered 499 and already an outcome
    metrics.observe_request("a", "/predict", 499, 0.001)
    metrics.observe_request("-", "/v2/models/{name}/infer", 404, 0.001)  # unknown model: all models only
    metrics.observe_request("a", "/v2/models/{name}", 404, 0.001)  # metadata: not an inference answer
    feed.sample()
    assert _column(feed, "client_error", "a") == [3.0]  # 6 over 2 s
    assert _column(feed, "client_error") == [3.5] and _column(feed, "cancelled", "a") == [0.5]


def test_the_models_table_summary_covers_the_recent_window():
    metrics = ServeMetrics(latency_buckets=BOUNDS)
    clocks = Clocks()
    feed = ConsoleFeed(metrics, interval_s=2.0, window_s=60.0, clock=clocks.mono, wall_clock=clocks.wall)
    feed.sample()
    assert feed.summary("a") is None  # one reading: nothing to compare yet
    for _ in range(3):
        clocks.now += 2.0
        for _ in range(9):
            metrics.count("a", "normal", "success")
            metrics.observe_request("a", "/predict", 200, 0.005)
        metrics.count("a", "normal", "error")
        metrics.observe_request("a", "/predict", 500, 0.5)
        metrics.observe_request("a", "/predict", 422, 0.001)
        metrics.preprocess.labels("a").observe(0.05)
        feed.sample()
    summary = feed.summary("a")
    assert summary is not None and summary["window_s"] == 6.0
    assert summary["requests_per_s"] == pytest.approx(11 / 2)  # 9 + 1 error + 1 client error per 2 s
    assert summary["error_ratio"] == pytest.approx(2 / 11, abs=1e-4)
    assert summary["latency_p50_ms"] < 10 < 100 < summary["latency_p99_ms"]
    assert 10 < summary["preprocess_p99_ms"] <= 100 and summary["postprocess_p99_ms"] is None
