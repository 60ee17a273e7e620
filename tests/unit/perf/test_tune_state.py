"""The state file: round trip, a changed context starts afresh, a broken file is set aside."""

from __future__ import annotations

import json

from servewell.perf.tune_state import TuneState
from servewell.perf.tuner import Candidate, LadderPoint, Measurement

CANDIDATE = Candidate(8, "window", 5.0, 1, 2, "auto")


def _measurement():
    points = [LadderPoint(8, 120.5, 3.0, 5.0, 9.5, 0), LadderPoint(16, 130.0, 6.0, 9.0, 20.0, 1)]
    return Measurement(CANDIDATE, [points])


def test_measurements_survive_a_round_trip(tmp_path):
    path = tmp_path / "out" / "tune-state.json"
    state = TuneState.open(path, {"slo_p99_ms": 50.0})
    state.record(_measurement())
    state.record(Measurement(Candidate(1, "idle", 0, 2, 1), [], failure="refused"))
    again = TuneState.open(path, {"slo_p99_ms": 50.0})
    assert again.resumed == 2 and again.note is None
    assert again.results[CANDIDATE.key] == _measurement()
    assert again.results[Candidate(1, "idle", 0, 2, 1).key].failure == "refused"
    assert not list(path.parent.glob("*.tmp"))


def test_another_context_starts_afresh_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "tune-state.json"
    state = TuneState.open(path, {"slo_p99_ms": 50.0})
    state.record(_measurement())
    fresh = TuneState.open(path, {"slo_p99_ms": 20.0})
    assert fresh.results == {} and fresh.resumed == 0 and "other settings" in fresh.note
    assert json.loads((tmp_path / "tune-state.json.old").read_text())["context"] == {"slo_p99_ms": 50.0}


def test_an_unreadable_file_is_set_aside(tmp_path):
    path = tmp_path / "tune-state.json"
    path.write_text("{not json")
    state = TuneState.open(path, {})
    assert state.results == {} and "could not be read" in state.note
    assert (tmp_path / "tune-state.json.old").read_text() == "{not json"
