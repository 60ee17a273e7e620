"""A manual clock for the scheduler (`servewell.engine.clock.Clock`): time moves only when a test
says so, and timers fire in order as it does. Timing rules are tested without sleeping."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class FakeTimer:
    """A scheduled callback; cancelling it keeps it from running."""

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """`now()` and `call_at()` over a time the test advances."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def pending(self) -> list[float]:
        """When the timers that will still fire are due."""
        return sorted(t.when for _, _, t in self._timers if not t.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time forward, firing every timer that comes due on the way, in order."""
        target = self.t + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.t = max(self.t, when)
            timer.callback()
        self.t = target
