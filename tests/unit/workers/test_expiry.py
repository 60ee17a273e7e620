"""The worker's last look at deadlines: which requests of a batch run, and their rows cut out."""

from __future__ import annotations

import numpy as np

from servewell.workers.expiry import keep_rows, plan_rows


def batch(rows: list[int]) -> dict[str, np.ndarray]:
    """Request i's rows hold the value i (two inputs, to check both are cut alike)."""
    x = np.concatenate([np.full((n, 2), i, dtype=np.float32) for i, n in enumerate(rows)])
    return {"x": x, "mask": x[:, :1].astype(np.int64)}


def test_only_requests_whose_deadline_is_still_ahead_are_kept() -> None:
    plan = plan_rows([2, 1, 3], [10.0, 5.0, 10.0], now=5.0)  # a deadline exactly now has passed
    assert (plan.kept, plan.skipped, plan.rows, plan.runs) == ((0, 2), (1,), 5, True)


def test_everything_expired_means_nothing_to_compute() -> None:
    plan = plan_rows([1, 1], [1.0, 2.0], now=3.0)
    assert (plan.kept, plan.skipped, plan.rows, plan.runs) == ((), (0, 1), 0, False)


def test_without_one_deadline_per_request_everything_runs() -> None:
    assert plan_rows([4], [], now=1e9).kept == (0,)
    assert plan_rows([1, 1], [0.0], now=1e9).skipped == ()


def test_rows_of_the_skipped_requests_are_cut_out_and_the_rest_stay_in_order() -> None:
    rows = [2, 1, 3]
    plan = plan_rows(rows, [10.0, 1.0, 10.0], now=5.0)
    kept = keep_rows(batch(rows), rows, plan)
    assert kept["x"][:, 0].tolist() == [0, 0, 2, 2, 2]
    assert kept["mask"].shape == (5, 1) and kept["mask"][:, 0].tolist() == [0, 0, 2, 2, 2]


def test_contiguous_survivors_are_a_view_and_a_full_batch_is_untouched() -> None:
    rows = [1, 2, 2]
    inputs = batch(rows)
    tail = keep_rows(inputs, rows, plan_rows(rows, [1.0, 10.0, 10.0], now=5.0))
    assert tail["x"][:, 0].tolist() == [1, 1, 2, 2] and np.shares_memory(tail["x"], inputs["x"])
    assert keep_rows(inputs, rows, plan_rows(rows, [10.0] * 3, now=5.0)) is inputs
