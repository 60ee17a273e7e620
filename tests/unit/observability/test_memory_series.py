"""Memory over time per process (observability/memory_series.py): one definition, processes named,
a growth rate over the current process's points and the time left to a limit."""

from __future__ import annotations

import pytest

from servewell.observability.memory_series import (
    DEFINITION,
    MemorySeries,
    ProcessMemory,
    growth_rate,
    worker_name,
)

MIB = 1 << 20


def worker(rss: int, pid: int = 10, limit: int | None = 512 * MIB) -> ProcessMemory:
    return ProcessMemory(worker_name("digits", "1", 0), "worker", pid, rss, limit, "digits", 0)


def test_growth_is_a_least_squares_slope_and_needs_enough_points_over_enough_time() -> None:
    assert growth_rate([(0.0, 100.0), (2.0, 120.0), (4.0, 140.0), (10.0, 200.0)]) == pytest.approx(10.0)
    assert growth_rate([(0.0, 1.0), (2.0, 2.0), (4.0, 3.0)]) is None  # three points
    assert growth_rate([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]) is None  # 3 s


def test_a_leaking_worker_has_a_growth_rate_and_a_time_to_its_limit() -> None:
    series = MemorySeries(interval_s=2.0, window_s=300.0)
    for i in range(10):
        series.sample(1000.0 + 2 * i, [worker(256 * MIB + i * 2 * MIB),
                                       ProcessMemory("engine", "engine", 1, 100 * MIB)])
    name = "worker digits v1 #0"
    assert series.growth(name) == pytest.approx(MIB)  # 2 MiB every 2 s
    assert series.seconds_to_limit(name) == pytest.approx((512 - 274) * MIB / MIB)
    assert series.growth("engine") == 0.0 and series.seconds_to_limit("engine") is None
    assert series.names() == ["engine", name]


def test_a_replaced_worker_keeps_its_name_and_its_growth_starts_again_with_the_new_pid() -> None:
    series = MemorySeries()
    for i in range(6):
        series.sample(float(2 * i), [worker(300 * MIB + i * 10 * MIB, pid=10)])
    series.sample(12.0, [worker(200 * MIB, pid=11)])
    name = "worker digits v1 #0"
    assert series.growth(name) is None  # one point of the new process: too few to tell
    doc = series.to_json()
    (line,) = doc["series"]
    assert line["pid"][-2:] == [10, 11] and line["rss_bytes"][-1] == 200 * MIB  # the sawtooth
    assert doc["definition"] == DEFINITION and doc["processes"][0]["pid"] == 11


def test_a_process_gone_for_a_window_is_forgotten_and_points_are_bounded() -> None:
    series = MemorySeries(interval_s=2.0, window_s=10.0)
    for i in range(20):
        series.sample(float(2 * i), [ProcessMemory("ingress 0", "ingress", 5, 10)])
    (line,) = series.to_json()["series"]
    assert len(line["t"]) == 5
    series.sample(100.0, [ProcessMemory("engine", "engine", 1, 10)])
    assert series.names() == ["engine"]


def test_at_most_max_processes_are_followed() -> None:
    series = MemorySeries(max_processes=2)
    series.sample(0.0, [ProcessMemory(f"worker m #{i}", "worker", i, 1) for i in range(5)])
    assert len(series.names()) == 2


def test_worker_names_say_model_version_and_instance() -> None:
    assert worker_name("digits", "1", 0) == "worker digits v1 #0"
    assert worker_name("digits", "", 2) == "worker digits #2"
