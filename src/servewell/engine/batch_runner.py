"""What the scheduler needs of whatever runs its batches: the `BatchRunner` boundary.

A leaf module (numpy and typing only): the worker side implements `BatchRunner` without
importing the scheduler, and tests drive the scheduler with small in-process fakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True, frozen=True)
class BatchOutcome:
    """Outputs of one batch (owned by the caller, not views into shared memory) and the
    runner's own timing of it."""

    outputs: dict[str, np.ndarray]
    compute_s: float
    steps: tuple[tuple[str, float], ...] = ()


class BatchRunner(Protocol):
    """Runs one batch at a time for a model's scheduler (a worker process, or a test fake)."""

    @property
    def alive(self) -> bool:
        """Whether it can still run batches; a dead runner is never handed another one."""
        ...

    async def run(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None) -> BatchOutcome:
        """Run the batch made of the row blocks in `parts`, concatenated along axis 0 per input.

        Raises a `ServeError` (`WorkerLost`, `WorkerHung`, `ModelError`) when the batch cannot be
        answered.
        """
        ...

    def declare_hung(self, reason: str) -> None:
        """Its batch overran the compute budget: stop it now (its owner replaces it); the `run`
        in progress then raises."""
        ...
