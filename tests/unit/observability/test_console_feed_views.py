"""The console feed's windowed views beyond the charts (observability/console_feed.py): the response
cache's hit ratio per point, refusals by model, lane, tenant and reason, each tenant's results over
the window, and the tick's memory sample and hooks."""

from __future__ import annotations

from servewell.observability.console_feed import ConsoleFeed, cache_between, refusals_between, tenants_between
from servewell.observability.memory_series import ProcessMemory
from servewell.observability.metrics import ServeMetrics


class Clocks:
    def __init__(self) -> None:
        self.now = 100.0

    def mono(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now


def _feed() -> tuple[ServeMetrics, Clocks, ConsoleFeed]:
    metrics, clocks = ServeMetrics(), Clocks()
    return metrics, clocks, ConsoleFeed(metrics, interval_s=2.0, window_s=60.0, clock=clocks.mono,
                                        wall_clock=clocks.wall)


def test_the_cache_hit_ratio_is_a_column_of_every_point() -> None:
    metrics, clocks, feed = _feed()
    feed.sample()
    clocks.now += 2.0
    for result, n in (("hit", 3), ("coalesced", 1), ("miss", 4)):
        for _ in range(n):
            metrics.cache_requests.labels("m", result).inc()
    feed.sample()
    columns = feed.series("m")["columns"]
    assert (columns["cache_hit"], columns["cache_coalesced"], columns["cache_miss"]) == ([1.5], [0.5], [2.0])
    assert columns["cache_hit_ratio"] == [0.375]
    clocks.now += 2.0
    feed.sample()
    assert feed.series("m")["columns"]["cache_hit_ratio"][-1] is None  # no lookup: no ratio


def test_cache_between_counts_lookups_repeats_and_the_reuse_intervals() -> None:
    metrics, clocks, feed = _feed()
    feed.sample()
    clocks.now += 2.0
    metrics.cache_requests.labels("m", "miss").inc(5)
    metrics.cache_reuses.labels("m", "beyond").inc(4)
    metrics.cache_reuses.labels("m", "within").inc(1)
    for seconds in (1.5, 25.0, 28.0, 29.0, 31.0):
        metrics.cache_reuse_interval.labels("m").observe(seconds)
    feed.sample()
    window = feed.window()
    assert window is not None
    found = cache_between(window[1], window[2], "m")
    assert (found["miss"], found["reused_beyond_ttl"], found["reused_within_ttl"]) == (5.0, 4.0, 1.0)
    assert {"le": 2.0, "count": 1} in found["reuse_histogram"] and {"le": 30.0, "count": 3} in found["reuse_histogram"]
    assert found["reuse_histogram"][-1] == {"le": "+Inf", "count": 0}
    assert 10.0 < found["reuse_p50_s"] <= 30.0


def test_refusals_and_tenants_over_the_window() -> None:
    metrics, clocks, feed = _feed()
    metrics.count_refusal("m", "normal", "alpha", "overloaded")  # before the window: not in it
    feed.sample()
    clocks.now += 2.0
    for _ in range(5):
        metrics.count_refusal("m", "normal", "alpha", "overloaded")
    metrics.count_refusal("m", "normal", "bravo", "overloaded")
    metrics.count_refusal("m", "normal", "bravo", "over_quota")
    metrics.tenant_requests.labels("bravo", "admitted").inc(10)
    metrics.tenant_requests.labels("bravo", "failed").inc(2)
    feed.sample()
    window = feed.window()
    assert window is not None
    _, before, after = window
    assert refusals_between(before, after, "m") == {("m", "normal", "alpha", "overloaded"): 5.0,
                                                    ("m", "normal", "bravo", "overloaded"): 1.0,
                                                    ("m", "normal", "bravo", "over_quota"): 1.0}
    tenants = tenants_between(before, after)
    assert tenants["alpha"] == {"refused": 5.0}  # a quota's refusal is counted by the quota, apart
    assert tenants["bravo"] == {"admitted": 10.0, "failed": 2.0, "refused": 1.0}


def test_each_tick_samples_the_processes_memory_and_runs_the_hooks_even_without_metrics() -> None:
    clocks = Clocks()
    feed = ConsoleFeed(None, clock=clocks.mono, wall_clock=clocks.wall)
    ticks: list[int] = []
    feed.memory_source = lambda: [ProcessMemory("engine", "engine", 1, 100)]
    feed.on_tick.append(lambda: ticks.append(1))

    def broken() -> None:
        raise RuntimeError("a broken hook is logged, never raised")

    feed.on_tick.insert(0, broken)
    feed.sample()
    assert ticks == [1] and feed.memory.latest()[0]["rss_bytes"] == 100
    assert feed.memory.latest()[0]["name"] == "engine"
