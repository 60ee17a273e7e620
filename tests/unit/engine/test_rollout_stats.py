"""The rollback rules' statistics (engine/rollout_stats.py): exact tails, and the quantile a latency
rule compares."""

from __future__ import annotations

import math

import pytest

from servewell.engine.rollout_stats import (
    binomial_upper_tail,
    compared_quantile,
    count_from,
    histogram_quantile_key,
    hypergeometric_upper_tail,
    quantile_label,
)


def test_fishers_tail_is_the_exact_hypergeometric_sum():
    # All 4 errors among the canary's 20 of 200 requests: C(20, 4) / C(200, 4).
    assert hypergeometric_upper_tail(4, 20, 4, 200) == pytest.approx(math.comb(20, 4) / math.comb(200, 4), rel=1e-9)
    exact = sum(math.comb(34, x) * math.comb(897, 92 - x) for x in range(9, 35)) / math.comb(931, 92)
    assert hypergeometric_upper_tail(9, 92, 34, 931) == pytest.approx(exact, rel=1e-9)
    assert hypergeometric_upper_tail(0, 5, 3, 10) == 1.0
    assert hypergeometric_upper_tail(4, 3, 3, 10) == 0.0  # more hits than draws: impossible
    with pytest.raises(ValueError):
        hypergeometric_upper_tail(1, 11, 3, 10)


def test_binomial_tail_is_exact_and_cheap_for_long_tails():
    assert binomial_upper_tail(1, 10, 0.1) == pytest.approx(1 - 0.9 ** 10, rel=1e-12)
    exact = sum(math.comb(40, x) * 0.05 ** x * 0.95 ** (40 - x) for x in range(8, 41))
    assert binomial_upper_tail(8, 40, 0.05) == pytest.approx(exact, rel=1e-9)
    assert binomial_upper_tail(0, 10, 0.5) == 1.0 and binomial_upper_tail(11, 10, 0.5) == 0.0
    assert 0.0 < binomial_upper_tail(500, 10_000_000, 0.00001) < 1e-100  # a tail of ten million terms, summed briefly


def test_the_compared_quantile_keeps_ten_answers_above_it():
    assert compared_quantile(0.99, 5000) == 0.99
    assert compared_quantile(0.99, 1000) == pytest.approx(0.99)
    assert compared_quantile(0.99, 100) == pytest.approx(0.9)
    assert compared_quantile(0.99, 92) == pytest.approx(1 - 10 / 92)
    assert compared_quantile(0.99, 20) == 0.5 and compared_quantile(0.99, 5) == 0.5
    assert quantile_label(0.99) == "p99" and quantile_label(1 - 10 / 92) == "p89.1" and quantile_label(0.5) == "p50"


def test_histogram_quantiles_and_counts_are_nearest_rank():
    bins = {1: 5, 3: 4, 7: 1}
    assert [histogram_quantile_key(bins, 10, q) for q in (0.1, 0.5, 0.51, 0.9, 0.99)] == [1, 1, 3, 3, 7]
    assert count_from(bins, 3) == 5 and count_from(bins, 8) == 0
