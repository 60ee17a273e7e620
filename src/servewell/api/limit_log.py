"""One log line per window for everything the HTTP limits did, however many connections it hit.

An attack is thousands of refusals a second: one line each would flood the log pipeline exactly
when it matters (and cost the event loop as much as the attack). The counts are exact; only the
lines are aggregated.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

#: Seconds between aggregated lines while events keep coming: prompt enough for an operator,
#: and at most 12 lines a minute.
WINDOW_S = 5.0

Scheduler = Callable[[float, Callable[[], None]], Any]


def _call_later(delay_s: float, callback: Callable[[], None]) -> Any:
    return asyncio.get_running_loop().call_later(delay_s, callback)


class LimitEventLog:
    """Counts enforcement events by reason; logs one WARNING line per window that had any."""

    def __init__(self, logger: logging.Logger, window_s: float = WINDOW_S, schedule: Scheduler = _call_later,
                 state: Callable[[], dict[str, int]] | None = None) -> None:
        self._logger = logger
        self._window_s = window_s
        self._schedule = schedule
        self._state = state
        self._pending: Counter[str] = Counter()
        self._flush_scheduled = False
        #: Every event since start, by reason.
        self.totals: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        """Count one event; the first of a window schedules that window's line."""
        self._pending[reason] += 1
        self.totals[reason] += 1
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._schedule(self._window_s, self.flush)

    def flush(self) -> None:
        """Log the window's counts as one line (nothing when there were none) and start a new window."""
        self._flush_scheduled = False
        if not self._pending:
            return
        counts = dict(sorted(self._pending.items()))
        self._pending.clear()
        state = self._state() if self._state is not None else {}
        summary = ", ".join(f"{reason} {count}" for reason, count in counts.items())
        self._logger.warning("HTTP limits enforced in the last %g s: %s", self._window_s, summary,
                             extra={"limit_events": counts, "window_s": self._window_s, **state})
