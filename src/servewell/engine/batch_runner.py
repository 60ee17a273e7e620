"""What the scheduler needs of whatever runs its batches: the `BatchRunner` boundary.

A leaf module (numpy, typing and the error taxonomy): the worker side implements `BatchRunner` without
importing the scheduler, and tests drive the scheduler with small in-process fakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from servewell.errors import ModelError


@dataclass(slots=True, frozen=True)
class BatchOutcome:
    """Outputs of one batch (owned by the caller, not views into shared memory) and the
    runner's own timing of it."""

    outputs: dict[str, np.ndarray]
    compute_s: float
    steps: tuple[tuple[str, float], ...] = ()
    #: Requests (indices into the batch's blocks) the runner did not run because their deadline had
    #: passed when it was about to compute; `outputs` hold the rows of the others, in order.
    skipped: tuple[int, ...] = ()


class BatchRunner(Protocol):
    """Runs one batch at a time for a model's scheduler (a worker process, or a test fake)."""

    @property
    def instance(self) -> int:
        """Which instance of the model it is (0-based), for the records of the requests it runs."""
        ...

    @property
    def alive(self) -> bool:
        """Whether it can still run batches; a dead runner is never handed another one."""
        ...

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                   deadlines: Sequence[float] = ()) -> asyncio.Future[BatchOutcome]:
        """Hand over the batch made of the row blocks in `parts`, concatenated along axis 0 per
        input, now (before this returns, where the runner is another process); the future gives
        its outcome. Block i of every input is request i; `deadlines[i]` is its absolute deadline
        (`time.monotonic()` seconds): a runner may skip the requests whose deadline has passed
        when it is about to compute, and says which in `BatchOutcome.skipped`.

        The scheduler starts a batch from inside its pump, so the rows are on their way before
        the bookkeeping around the batch runs (a task, the watch, the span). Raises, or the
        future fails with, a `ServeError` (`WorkerLost`, `WorkerHung`, `ModelError`) when the batch
        cannot be answered.
        """
        ...

    def declare_hung(self, reason: str) -> None:
        """Its batch overran the compute budget: stop it now (its owner replaces it); the `run`
        in progress then raises."""
        ...


def split_rows(outputs: dict[str, np.ndarray], rows: list[int], batched: bool) -> list[dict[str, np.ndarray]]:
    """A batch's outputs cut into each request's rows (views); a model without a batch
    dimension (`batched` false) runs one request at a time and its outputs are that request's.
    `ModelError` when an output does not have one row per input row."""
    if not batched:
        return [outputs]
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            got = array.shape[0] if array.ndim else 0
            raise ModelError(f"output '{name}' has {got} rows for a batch of {total}")
    results: list[dict[str, np.ndarray]] = []
    start = 0
    for count in rows:
        results.append({name: array[start : start + count] for name, array in outputs.items()})
        start += count
    return results
