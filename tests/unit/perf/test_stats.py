"""Percentiles and spreads: nearest rank, never below an observed value."""

from __future__ import annotations

from servewell.perf.stats import median, percentile, relative_spread, summarize_ms


def test_nearest_rank_percentiles_of_a_hundred_values():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) is None


def test_a_p99_of_few_samples_is_the_largest_not_an_interpolation():
    assert percentile([1.0, 2.0, 3.0], 99) == 3.0
    assert percentile([5.0], 1) == 5.0


def test_summary_is_ordered_and_counts_every_value():
    summary = summarize_ms([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0])
    assert summary["n"] == 10
    assert summary["mean"] == 5.5
    assert summary["p50"] <= summary["p90"] <= summary["p95"] <= summary["p99"] <= summary["max"] == 10.0
    assert summarize_ms([])["p99"] is None


def test_spread_is_relative_to_the_median():
    assert relative_spread([100.0, 110.0, 90.0]) == 0.2
    assert relative_spread([100.0]) is None
    assert median([1.0, 3.0]) == 2.0
    assert median([3.0, 1.0, 2.0]) == 2.0
