"""A running batch's budget: its requests are answered at their deadlines even while it runs, and
a batch that runs past its compute budget is declared hung.

Before this, a request whose batch was running waited for the batch however long it took: a
worker stopped with SIGSTOP for 10 s answered its running batch with 200 after 11.3 s, long past
the requests' 2 s deadlines. Now each request gets 503 `deadline_exceeded` at its deadline, and
once the batch passes its compute budget the rest get 503 `worker_hung` and the worker is killed
and replaced. The budget comes from the model's `batching.compute_timeout_ms`, else from the
latency warm-up measured for that batch size (or the scheduler's learned latency, whichever is
larger) times a generous factor, never below a floor: a false alarm kills a healthy worker, so
the budget catches hangs, not slowness. Client deadlines never declare a worker hung (a client
could otherwise kill workers by sending tiny timeouts).

Pure and driven by the injectable `Clock`: unit-tested without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from servewell.engine.clock import Clock, TimerHandle

#: The compute budget is this many times the batch's measured latency...
COMPUTE_BUDGET_FACTOR = 20.0
#: ...and never less than this: CPU contention on a busy host can make a batch several times slower.
COMPUTE_BUDGET_FLOOR_S = 10.0
#: Without warm-up measurements (`warmup: false`) the first batches may load lazy weights: be patient.
UNMEASURED_COMPUTE_BUDGET_S = 60.0
#: A configured `compute_timeout_ms` is never shorter than this many times the batch's measured latency:
#: a budget the model cannot meet declares every batch hung (issue 19.10: 0.001 ms served 0 of 6,367
#: requests and restarted the workers 4 times). 3x leaves room for the slowdown CPU contention brings.
CONFIGURED_BUDGET_MIN_FACTOR = 3.0

T = TypeVar("T")


def compute_budget_s(rows: int, warmup_latency_s: Mapping[int, float], learned_latency_s: float | None = None,
                     configured_ms: float | None = None) -> float:
    """Seconds a batch of `rows` may run before its worker is declared hung.

    The measured latency is the warm-up latency of the smallest warmed-up batch size that holds
    `rows` (scaled linearly beyond the largest), or the learned latency if larger. `configured_ms`
    (the model's `batching.compute_timeout_ms`) wins, but is never less than
    `CONFIGURED_BUDGET_MIN_FACTOR` times the measured latency. Otherwise: the measured latency
    times `COMPUTE_BUDGET_FACTOR`, at least `COMPUTE_BUDGET_FLOOR_S`;
    `UNMEASURED_COMPUTE_BUDGET_S` when nothing was measured.
    """
    measured: float | None = None
    if warmup_latency_s:
        sizes = sorted(warmup_latency_s)
        fit = next((size for size in sizes if size >= rows), None)
        measured = warmup_latency_s[fit] if fit is not None else warmup_latency_s[sizes[-1]] * rows / sizes[-1]
    if learned_latency_s is not None:
        measured = max(measured or 0.0, learned_latency_s)
    if configured_ms is not None:
        return max(configured_ms / 1000.0, CONFIGURED_BUDGET_MIN_FACTOR * (measured or 0.0))
    if measured is None:
        return UNMEASURED_COMPUTE_BUDGET_S
    return max(COMPUTE_BUDGET_FLOOR_S, COMPUTE_BUDGET_FACTOR * measured)


class BatchWatch(Generic[T]):
    """Watches one running batch: calls `expire(item, now)` for each item whose deadline passes
    while it is still open, and `overrun(now)` once when `budget_at` passes. One timer at a time,
    at the earliest of the next open deadline and the budget."""

    def __init__(
        self,
        clock: Clock,
        items: Sequence[tuple[float, T]],
        budget_at: float,
        is_open: Callable[[T], bool],
        expire: Callable[[T, float], None],
        overrun: Callable[[float], None],
    ) -> None:
        self._clock = clock
        self._items = sorted(items, key=lambda pair: pair[0])
        self.budget_at = budget_at
        self._is_open = is_open
        self._expire = expire
        self._overrun = overrun
        self._timer: TimerHandle | None = None
        self.overran = False
        self._stopped = False
        self._arm()

    def _arm(self) -> None:
        if self._stopped:
            return
        wake_at = None if self.overran else self.budget_at
        for deadline_at, item in self._items:
            if self._is_open(item):
                wake_at = deadline_at if wake_at is None else min(wake_at, deadline_at)
                break  # sorted by deadline: the first open one is the earliest
        self._timer = self._clock.call_at(wake_at, self._check) if wake_at is not None else None

    def _check(self) -> None:
        self._timer = None
        now = self._clock.now()
        for deadline_at, item in self._items:
            if deadline_at > now:
                break
            if self._is_open(item):
                self._expire(item, now)
        if not self.overran and now >= self.budget_at:
            self.overran = True
            self._overrun(now)
        self._arm()

    def stop(self) -> None:
        """The batch ended: no more callbacks."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
