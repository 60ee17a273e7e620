"""When a scheduler's pump runs besides at once: at one time on a timer, and at the end of the
current event-loop step.

The timer is kept while the time it is asked for stays the same (under load nearly every pump
asks for the same one: the earliest queued deadline), so a pump does not cancel and make a timer
each. The end-of-step pump runs once however many ask for it during the step
(`ModelScheduler.submit(coalesce=True)`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from servewell.engine.clock import Clock, TimerHandle


class PumpWakeups:
    """Calls `pump` at the time last asked for (`at`), and once at the end of this loop step (`soon`)."""

    __slots__ = ("_clock", "_pump", "_timer", "_timer_at", "_soon")

    def __init__(self, clock: Clock, pump: Callable[[], None]) -> None:
        self._clock = clock
        self._pump = pump
        self._timer: TimerHandle | None = None
        self._timer_at: float | None = None  # when `_timer` fires
        self._soon = False  # a pump is due at the end of this loop step

    def at(self, when: float | None) -> None:
        """Pump at `when` (None: on no timer); a timer already set for that time is kept."""
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._clock.call_at(when, self._on_timer) if when is not None else None
        self._timer_at = when

    def by(self, when: float) -> None:
        """Pump at `when` at the latest: the timer moves earlier if it was set later (or not at all)."""
        if self._timer_at is None or when < self._timer_at:
            self.at(when)

    def soon(self) -> None:
        """Pump once when this event-loop step ends, with everything queued during it."""
        if not self._soon:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._on_soon)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None  # fired: the next pump asks again
        self._pump()

    def _on_soon(self) -> None:
        self._soon = False
        self._pump()
