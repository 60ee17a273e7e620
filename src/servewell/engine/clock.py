"""The scheduler's time source: the event loop's clock in production, a manual one in tests.

The scheduler only ever asks "what time is it" and "call me back at t", so a fake clock makes
every timing rule (batching windows, deadlines) testable without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    """A scheduled callback that can be cancelled."""

    def cancel(self) -> None:
        """Do not run the callback."""
        ...


class Clock(Protocol):
    """Monotonic seconds and one-shot timers."""

    def now(self) -> float:
        """Current time in seconds on the deadline clock: `time.monotonic()` in production, so an
        absolute deadline means the same in every process of the server (a fake clock in tests)."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """Run `callback` at time `when` (at once if it has passed)."""
        ...


def precise_time(clock: Clock) -> Callable[[], float]:
    """A reader of `clock`'s time to report durations with (a request's queue time): for the event
    loop's clock, `time.monotonic` itself (the same clock, which uvloop's `loop.time()` rounds to
    whole milliseconds: every queue time read 0.000 or 1.000 ms); any other clock (a test's) as it is."""
    return time.monotonic if isinstance(clock, LoopClock) else clock.now


class LoopClock:
    """The running event loop's clock (`loop.time()`, `loop.call_at`)."""

    def now(self) -> float:
        """`loop.time()` of the running loop."""
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """`loop.call_at` of the running loop."""
        return asyncio.get_running_loop().call_at(when, callback)
