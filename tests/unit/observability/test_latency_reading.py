"""The p99 split and its one-line reading: each rule with plain numbers."""

from __future__ import annotations

import pytest

from servewell.observability.latency_reading import compute_grows_with_batch_size, latency_split


def summary(p99: float | None, queue: float = 0.0, compute: float = 0.0, pre: float = 0.0, post: float = 0.0,
            compute_p50: float | None = None) -> dict:
    return {"latency_p99_ms": p99, "queue_p99_ms": queue, "compute_p99_ms": compute, "preprocess_p99_ms": pre,
            "postprocess_p99_ms": post, "compute_p50_ms": compute if compute_p50 is None else compute_p50}


def by_size(*rows: tuple[int, float, int]) -> list[dict]:
    return [{"batch_size": b, "p50_ms": p50, "p99_ms": p50 * 1.2, "count": n} for b, p50, n in rows]


GROWING = by_size((1, 10.0, 20), (4, 16.0, 20), (8, 30.0, 20))


def test_no_traffic_has_no_split():
    split = latency_split(None)
    assert split.p99_ms is None and split.reading == "no inference requests in the window"
    assert latency_split(summary(None)).reading == "no inference requests in the window"


def test_stage_p99s_over_the_total_are_scaled_to_sum_to_it():
    split = latency_split(summary(100.0, queue=80.0, compute=80.0, pre=20.0, post=20.0))
    assert split.queue_ms == 40.0 and split.compute_ms == 40.0 and split.preprocess_ms == 10.0
    assert split.queue_ms + split.compute_ms + split.preprocess_ms + split.postprocess_ms == pytest.approx(100.0)
    under = latency_split(summary(100.0, queue=10.0, compute=30.0))  # the rest: outside the stages
    assert (under.queue_ms, under.compute_ms) == (10.0, 30.0)
    assert set(under.to_json()) == {"p99_ms", "queue_ms", "compute_ms", "preprocess_ms", "postprocess_ms", "reading",
                                    "cause"}


def test_compute_grows_with_batch_size():
    assert compute_grows_with_batch_size(GROWING)
    assert not compute_grows_with_batch_size(by_size((1, 10.0, 20), (8, 12.0, 20)))  # flat: batching pays
    assert not compute_grows_with_batch_size(by_size((1, 10.0, 20), (8, 30.0, 2)))  # too few batches of 8
    assert not compute_grows_with_batch_size(by_size((4, 10.0, 20)))
    assert not compute_grows_with_batch_size(None)
    assert not compute_grows_with_batch_size([{"batch_size": "x"}, {}])  # malformed rows are left out
    split = latency_split(summary(100.0, queue=30.0, compute=60.0), GROWING)
    assert split.reading.startswith("compute grows with batch size")
    # Without the per-size figures the same split only says compute dominates.
    assert latency_split(summary(100.0, queue=30.0, compute=60.0)).reading.startswith("compute dominates")


def test_queue_wait_dominates_capacity():
    split = latency_split(summary(100.0, queue=70.0, compute=20.0, compute_p50=15.0))
    assert split.reading.startswith("queue wait dominates: capacity")
    # Growth with batch size is not the story when the queue is the largest stage.
    assert latency_split(summary(100.0, queue=70.0, compute=20.0), GROWING).reading.startswith("queue wait")


def test_one_slow_batch_blocks_the_queue():
    split = latency_split(summary(500.0, queue=300.0, compute=200.0, compute_p50=10.0))
    assert split.reading.startswith("one slow batch blocks the queue")


def test_preprocessing_postprocessing_compute_or_nothing_dominates():
    assert latency_split(summary(100.0, pre=60.0, compute=10.0)).reading.startswith(
        "preprocessing dominates: decoding")
    assert latency_split(summary(100.0, post=60.0)).reading.startswith("postprocessing dominates")
    assert latency_split(summary(100.0, compute=60.0)).reading == "compute dominates: the model itself"
    assert latency_split(summary(100.0, queue=30.0, compute=30.0, pre=30.0)).reading == "no stage dominates"
