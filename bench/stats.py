"""Latency summaries shared by the load generator and the report."""

from __future__ import annotations

import math
from typing import Iterable

PERCENTILES = (50, 95, 99)


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
    """n, mean, p50, p95, p99 and max of durations given in milliseconds."""
    ordered = sorted(values)
    doc: dict[str, float | int | None] = {"n": len(ordered)}
    doc["mean"] = round(sum(ordered) / len(ordered), 3) if ordered else None
    for q in PERCENTILES:
        value = percentile(ordered, q)
        doc[f"p{q}"] = round(value, 3) if value is not None else None
    doc["max"] = round(ordered[-1], 3) if ordered else None
    return doc
