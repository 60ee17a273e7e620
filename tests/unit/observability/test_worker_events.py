"""Worker replacements as events (observability/worker_events.py): every cause counted the same way,
each with the gap it caused and whether other instances served meanwhile."""

from __future__ import annotations

from servewell.observability.worker_events import REASONS, WorkerEvents


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_replacement_has_its_cause_and_the_gap_until_its_successor_is_ready() -> None:
    mono, wall = Clock(50.0), Clock(1_700_000_000.0)
    events = WorkerEvents(clock=mono, wall_clock=wall)
    events.left("digits", "1", 0, "memory", "resident memory 612 MiB exceeds 512 MiB", 101, others_serving=0)
    (open_event,) = events.to_json("digits")
    assert open_event["gap_s"] is None and open_event["open_s"] == 0.0 and open_event["clients_waited"]
    mono.t += 2.75
    events.back("digits", "1", 0, 202)
    (done,) = events.to_json("digits")
    assert done | {"at": 0} == {"model": "digits", "version": "1", "instance": 0, "reason": "memory",
                                 "detail": "resident memory 612 MiB exceeds 512 MiB", "at": 0, "pid": 101,
                                 "new_pid": 202, "others_serving": 0, "clients_waited": True, "gap_s": 2.75}
    assert done["at"] == 1_700_000_000.0


def test_every_cause_counts_as_a_restart_and_by_its_reason() -> None:
    events = WorkerEvents(clock=Clock(0.0))
    events.left("m", "1", 0, "crash", "exit code 1", 1, 1)
    events.back("m", "1", 0, 2)
    events.left("m", "1", 1, "hung", "no heartbeat", 3, 1)
    events.back("m", "1", 1, 4)
    events.left("m", "1", 0, "memory", "over", 2, 1)
    assert events.counts("m") == {"crash": 1, "hung": 1, "memory": 1} and events.total("m") == 3
    assert events.counts("other") == dict.fromkeys(REASONS, 0)


def test_a_second_cause_while_the_replacement_is_open_counts_and_the_gap_runs_from_the_first() -> None:
    mono = Clock(10.0)
    events = WorkerEvents(clock=mono)
    events.left("m", "1", 0, "memory", "over", 1, 0)
    mono.t = 12.0
    events.left("m", "1", 0, "crash", "the replacement failed to load", 1, 0)
    mono.t = 15.0
    events.back("m", "1", 0, 9)
    (event,) = events.recent("m")
    assert event.reason == "memory" and event.gap_s == 5.0 and events.counts("m")["crash"] == 1


def test_a_first_start_closes_nothing() -> None:
    events = WorkerEvents()
    events.back("m", "1", 0, 5)
    assert events.recent() == []


def test_recent_keeps_those_that_ended_or_are_open_within_the_window() -> None:
    mono = Clock(0.0)
    events = WorkerEvents(clock=mono)
    events.left("m", "1", 0, "crash", "x", 1, 0)
    events.back("m", "1", 0, 2)
    mono.t = 100.0
    events.left("m", "1", 0, "crash", "y", 2, 0)
    assert [e.detail for e in events.recent("m", within_s=60)] == ["y"]  # the open one counts
    assert [e.detail for e in events.recent("m", within_s=200)] == ["x", "y"]
