"""A stand-in for a model's scheduler behind the response cache (engine/response_cache.py): each
`submit()` is one computation, held until the test answers or fails it, so a test counts exactly
how many computations the cache asked for and decides when each ends."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np

from servewell.engine.protocol import RequestResult


class HeldComputations:
    """A submit whose computations the test finishes by hand, and the outcomes counted for the
    requests the scheduler would not count (`count`)."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[RequestResult]] = []
        self.outcomes: Counter[str] = Counter()

    def submit(self) -> asyncio.Future[RequestResult]:
        """Queue one computation (a future the test resolves)."""
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self.calls.append(future)
        return future

    def count(self, outcome: str) -> None:
        """Count one request's outcome."""
        self.outcomes[outcome] += 1

    def answer(self, index: int, value: float, rows: int = 1) -> np.ndarray:
        """Answer computation `index` with `rows` rows of 4 floats `value`, views of a larger batch
        as the scheduler's are; the batch."""
        batch = np.full((rows + 1, 4), value, dtype=np.float32)
        self.calls[index].set_result(RequestResult({"y": batch[:rows]}, 0.001, 0.002, rows + 1))
        return batch
