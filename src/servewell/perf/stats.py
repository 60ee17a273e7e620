"""Latency summaries shared by the load generator, the sweep report, the tuner and `bench/`."""

from __future__ import annotations

import math
from collections.abc import Iterable

#: The percentiles every latency summary carries.
PERCENTILES = (50, 90, 95, 99)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of already sorted values; None when empty.

    Nearest rank never interpolates below an observed value, so a p99 of few samples is
    the conservative (larger) one.
    """
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize_ms(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, mean, p50, p90, p95, p99 and max of durations given in milliseconds."""
    ordered = sorted(values)
    doc: dict[str, float | int | None] = {"n": len(ordered)}
    doc["mean"] = round(sum(ordered) / len(ordered), 3) if ordered else None
    for q in PERCENTILES:
        value = percentile(ordered, q)
        doc[f"p{q}"] = round(value, 3) if value is not None else None
    doc["max"] = round(ordered[-1], 3) if ordered else None
    return doc


def completion_rate(done_times: Iterable[float], cluster_s: float = 0.005) -> float | None:
    """Answers per second between the first and the last completion; None with too few.

    Batched answers finish in clusters (a closed loop of 16 clients and batches of 8 completes
    8 at a time), so answers counted in a fixed window jump in steps of a whole batch: 8 answers
    in 10 s is 4% of a 20 img/s model. Counting from the end of the first cluster to the last
    answer measures whole inter-batch intervals instead and has no such step.
    """
    ordered = sorted(done_times)
    if len(ordered) < 2:
        return None
    first_cluster = sum(1 for t in ordered if t <= ordered[0] + cluster_s)
    span = ordered[-1] - ordered[0]
    if span <= cluster_s or first_cluster == len(ordered):
        return None
    return (len(ordered) - first_cluster) / span


def relative_spread(values: list[float]) -> float | None:
    """(max - min) / median of repeated measurements of one figure; None with fewer than two.

    What a second measurement of the same thing can differ by on this machine: a difference
    between two settings smaller than this is not evidence that one is better.
    """
    if len(values) < 2:
        return None
    ordered = sorted(values)
    middle = median(ordered)
    if middle <= 0:
        return None
    return (ordered[-1] - ordered[0]) / middle


def median(values: list[float]) -> float:
    """The median of a non-empty list (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2.0
