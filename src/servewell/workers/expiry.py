"""Worker side: drop the requests of a batch whose deadline passed on the way (pure, numpy only).

A batch is formed, copied into shared memory and sent over a pipe; a worker that was busy, or
a pipe that was slow, can hand it over after some of its requests' deadlines passed. Their
clients have been answered `deadline_exceeded` by the engine already (`engine/batch_watch.py`),
so computing their rows is waste that delays everyone behind them. Right before compute the
worker keeps only the live requests (`plan_rows`), slices their rows out of the batch
(`keep_rows`) and reports the others as skipped in `BatchDone.skipped`; the outputs then hold
the rows of the kept requests only, in order.

Deadlines are absolute `time.monotonic()` seconds (the server's one deadline unit; the clock is
system-wide, so the engine's and the worker's readings compare directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class RowPlan:
    """Which requests of a batch run, and which are skipped (indices into the batch's requests)."""

    kept: tuple[int, ...]
    skipped: tuple[int, ...]
    rows: int  # rows of the kept requests together

    @property
    def runs(self) -> bool:
        """Whether anything is left to compute."""
        return bool(self.kept)


def plan_rows(request_rows: Sequence[int], deadlines: Sequence[float], now: float) -> RowPlan:
    """Keep the requests whose deadline is still ahead of `now`. Without one deadline per request
    there is nothing to judge: every request is kept."""
    if len(deadlines) != len(request_rows):
        return RowPlan(tuple(range(len(request_rows))), (), sum(request_rows))
    kept = tuple(i for i, deadline in enumerate(deadlines) if deadline > now)
    skipped = tuple(i for i, deadline in enumerate(deadlines) if deadline <= now)
    return RowPlan(kept, skipped, sum(request_rows[i] for i in kept))


def keep_rows(inputs: dict[str, np.ndarray], request_rows: Sequence[int], plan: RowPlan) -> dict[str, np.ndarray]:
    """The inputs cut down to the kept requests' rows, in order: the inputs themselves when every
    request is kept, a view when the kept ones are contiguous, else a copy of their rows."""
    if not plan.skipped:
        return inputs
    starts = [0]
    for count in request_rows:
        starts.append(starts[-1] + count)
    first, last = plan.kept[0], plan.kept[-1]
    if last - first + 1 == len(plan.kept):  # one run of neighbours: a view, no copy
        return {name: array[starts[first] : starts[last + 1]] for name, array in inputs.items()}
    return {
        name: np.concatenate([array[starts[i] : starts[i + 1]] for i in plan.kept]) for name, array in inputs.items()
    }
