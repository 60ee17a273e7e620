"""Slow-request lines: every one of a trickle, a bounded number with exemplars for a flood."""

from __future__ import annotations

import logging

import pytest

from fake_clock import FakeClock
from servewell.observability.recent_requests import RequestRecord
from servewell.observability.slow_log import SlowRequestLog


def slow_log(clock: FakeClock, name: str, **options) -> SlowRequestLog:
    return SlowRequestLog(logging.getLogger(name), schedule=lambda delay_s, callback: clock.call_at(
        clock.now() + delay_s, callback), **options)


def record(i: int, total_ms: float, model: str = "digits") -> RequestRecord:
    return RequestRecord(f"req-{i}", "http", "/predict", model, 200, "", total_ms, True,
                         {"queue": total_ms - 2.0, "compute": 2.0}, batch_id=100 + i, batch_size=8, instance=1,
                         queue_position=i % 50)


def test_a_flood_of_1000_in_a_second_logs_a_bounded_number_of_lines_with_exemplars(caplog):
    clock = FakeClock()
    log = slow_log(clock, "test.slow.flood", window_s=10.0, lines_per_window=5, worst_kept=3)
    with caplog.at_level(logging.INFO, "test.slow.flood"):
        for i in range(1000):
            log.slow(record(i, 300.0 + i))  # 300 .. 1299 ms: req-999 is the slowest
            clock.advance(0.001)
        log.slow(record(5000, 400.0, model="other"))
        assert len(caplog.records) == 6  # five of digits and the first of "other"; the rest wait
        clock.advance(10.0)
    lines = caplog.records
    assert len(lines) == 7 and all(r.levelno == logging.WARNING for r in lines)
    assert [r.request_id for r in lines[:5]] == ["req-0", "req-1", "req-2", "req-3", "req-4"]
    assert lines[0].batch_id == 100 and lines[0].stages_ms == {"queue": 298.0, "compute": 2.0}
    (summary,) = [r for r in lines if getattr(r, "suppressed", None)]
    assert summary.suppressed == 995 and summary.logged == 5 and summary.model == "digits"
    assert [w["request_id"] for w in summary.worst] == ["req-999", "req-998", "req-997"]
    worst = summary.worst[0]
    assert worst["total_ms"] == 1299.0 and worst["stages_ms"] == {"queue": 1297.0, "compute": 2.0}
    assert (worst["batch_id"], worst["batch_size"], worst["instance"], worst["queue_position"]) == (1099, 8, 1, 49)
    # the suppressed were 305 .. 1299 ms: exact nearest-rank percentiles (fewer than the sample size)
    assert summary.p50_ms == pytest.approx(802.0) and summary.p99_ms == pytest.approx(1290.0)
    assert "req-999 1299.0 ms" in summary.getMessage() and "995 more" in summary.getMessage()


def test_a_trickle_still_logs_each_request_and_no_summary(caplog):
    clock = FakeClock()
    log = slow_log(clock, "test.slow.trickle", window_s=10.0, lines_per_window=5)
    with caplog.at_level(logging.INFO, "test.slow.trickle"):
        for i in range(30):  # one every 2.5 s: four a window
            log.slow(record(i, 500.0))
            clock.advance(2.5)
        clock.advance(10.0)
    assert [r.request_id for r in caplog.records] == [f"req-{i}" for i in range(30)]
    assert not any(hasattr(r, "suppressed") for r in caplog.records)


def test_the_summary_sample_stays_bounded_and_windows_start_again(caplog):
    clock = FakeClock()
    log = slow_log(clock, "test.slow.sample", window_s=1.0, lines_per_window=0, sample_size=64)
    with caplog.at_level(logging.INFO, "test.slow.sample"):
        for i in range(5000):
            log.slow(record(i, 100.0))
        clock.advance(1.0)
        log.slow(record(1, 100.0))
        log.flush_all()
    assert [r.suppressed for r in caplog.records] == [5000, 1]
    assert caplog.records[0].p99_ms == 100.0
