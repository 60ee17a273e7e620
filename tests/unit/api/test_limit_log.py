"""Enforcement events: exact counts, one log line per window however many there were."""

from __future__ import annotations

import logging
from collections.abc import Callable

from servewell.api.limit_log import LimitEventLog


class Timers:
    """A scheduler that records what was scheduled; the test fires it."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.scheduled.append((delay_s, callback))

    def fire(self) -> None:
        _, callback = self.scheduled.pop(0)
        callback()


def test_a_burst_of_events_is_one_line_with_exact_counts(caplog):
    timers = Timers()
    events = LimitEventLog(logging.getLogger("test.limits"), window_s=5.0, schedule=timers,
                           state=lambda: {"open_connections": 7})
    with caplog.at_level(logging.WARNING, logger="test.limits"):
        for _ in range(3000):
            events.add("evicted")
        events.add("header_timeout")
        assert len(timers.scheduled) == 1 and timers.scheduled[0][0] == 5.0
        assert caplog.records == []
        timers.fire()
    (record,) = caplog.records
    assert record.limit_events == {"evicted": 3000, "header_timeout": 1}
    assert record.open_connections == 7
    assert "evicted 3000" in record.getMessage()


def test_each_window_with_events_gets_its_own_line_and_totals_add_up(caplog):
    timers = Timers()
    events = LimitEventLog(logging.getLogger("test.limits"), schedule=timers)
    with caplog.at_level(logging.WARNING, logger="test.limits"):
        events.add("refused_connection")
        timers.fire()
        assert timers.scheduled == []  # a quiet window schedules nothing
        events.add("refused_connection")
        events.add("malformed")
        timers.fire()
    assert [r.limit_events for r in caplog.records] == [{"refused_connection": 1},
                                                         {"malformed": 1, "refused_connection": 1}]
    assert events.totals == {"refused_connection": 2, "malformed": 1}
