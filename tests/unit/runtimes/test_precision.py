"""The distance between reduced-precision outputs and their fp32 reference."""

from __future__ import annotations

import numpy as np

from servewell.runtimes.precision import PrecisionCheck, max_relative_difference


def test_identical_outputs_differ_by_nothing() -> None:
    y = np.array([[1.0, -2.0, 3.0]], dtype=np.float32)
    assert max_relative_difference({"y": y.copy()}, {"y": y}) == 0.0


def test_difference_is_relative_to_the_largest_reference_magnitude() -> None:
    reference = {"y": np.array([0.0, -4.0, 2.0])}
    outputs = {"y": np.array([0.1, -4.0, 2.0])}  # 0.1 off where the reference is 0: not infinite
    assert np.isclose(max_relative_difference(outputs, reference), 0.1 / 4.0)


def test_worst_output_wins_and_non_floating_outputs_are_not_compared() -> None:
    reference = {"a": np.array([1.0, 1.0]), "b": np.array([10.0]), "ids": np.array([3, 1])}
    outputs = {"a": np.array([1.0, 1.2]), "b": np.array([10.5]), "ids": np.array([1, 3])}
    assert np.isclose(max_relative_difference(outputs, reference), 0.2)


def test_non_finite_values_count_only_where_they_differ() -> None:
    reference = {"y": np.array([np.nan, np.inf, 1.0])}
    assert max_relative_difference({"y": np.array([np.nan, np.inf, 1.0])}, reference) == 0.0
    assert max_relative_difference({"y": np.array([np.nan, np.inf, np.nan])}, reference) == float("inf")


def test_a_nonzero_difference_from_an_all_zero_reference_is_infinite() -> None:
    assert max_relative_difference({"y": np.array([1e-3])}, {"y": np.array([0.0])}) == float("inf")


def test_a_check_says_when_it_fell_back() -> None:
    assert PrecisionCheck("bf16", "fp32", 0.2).fell_back_to_fp32
    assert not PrecisionCheck("bf16", "bf16", 0.01).fell_back_to_fp32
