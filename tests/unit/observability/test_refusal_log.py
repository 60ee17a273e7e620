"""Refusals are logged once per model, code and window, with an exact count."""

from __future__ import annotations

import logging

from servewell.observability.refusal_log import RefusalDigest


class Timers:
    """A fake `call_later`: callbacks run when the test says so."""

    def __init__(self) -> None:
        self.pending: list = []

    def __call__(self, delay_s, callback):
        self.pending.append((delay_s, callback))

    def fire(self) -> None:
        pending, self.pending = self.pending, []
        for _, callback in pending:
            callback()


def test_one_line_per_model_and_code_with_the_count(caplog):
    timers = Timers()
    digest = RefusalDigest(logging.getLogger("test.refusals"), 1.0, timers)
    with caplog.at_level(logging.INFO, "test.refusals"):
        for _ in range(500):
            digest.refused("a", "overloaded", 503, "lane full")
        for _ in range(3):
            digest.refused("b", "overloaded", 503, "lane full")
        digest.refused("a", "deadline_exceeded", 503, "too late")
        assert caplog.records == []  # nothing until the window ends
        assert [d for d, _ in timers.pending] == [1.0, 1.0, 1.0]
        timers.fire()
    lines = {(r.model, r.code): r.count for r in caplog.records}
    assert lines == {("a", "overloaded"): 500, ("b", "overloaded"): 3, ("a", "deadline_exceeded"): 1}
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_a_new_window_opens_after_the_last_one_is_logged(caplog):
    timers = Timers()
    digest = RefusalDigest(logging.getLogger("test.refusals2"), 1.0, timers)
    with caplog.at_level(logging.INFO, "test.refusals2"):
        digest.refused("a", "overloaded", 503, "x")
        timers.fire()
        digest.refused("a", "overloaded", 503, "x")
        digest.refused("a", "overloaded", 503, "x")
        digest.flush_all()
    assert [r.count for r in caplog.records] == [1, 2]
