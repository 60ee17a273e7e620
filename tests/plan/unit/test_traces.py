"""Load shapes and the trace-file reader, hostile files included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from servewell_plan import traces
from servewell_plan.model import FaultKind


def test_steady_holds_the_rate():
    trace = traces.steady(50.0, 10.0, step_s=2.0)
    assert trace.rates_rps == (50.0,) * 5
    assert trace.duration_s == 10.0


def test_diurnal_peaks_at_exactly_the_peak_in_the_afternoon_and_bottoms_out_at_night():
    trace = traces.diurnal(1000.0, bursts_per_day=0)
    rates = np.asarray(trace.rates_rps)
    assert len(rates) == 1440
    assert rates.max() == pytest.approx(1000.0, rel=1e-12)
    assert 13 * 3600 <= np.argmax(rates) * 60 <= 15 * 3600
    assert 1 * 3600 <= np.argmin(rates) * 60 <= 3 * 3600
    assert rates.min() == pytest.approx(250.0, rel=1e-3)


def test_diurnal_bursts_are_seeded_and_the_peak_includes_them():
    a = traces.diurnal(1000.0, seed=1, bursts_per_day=20)
    b = traces.diurnal(1000.0, seed=1, bursts_per_day=20)
    c = traces.diurnal(1000.0, seed=2, bursts_per_day=20)
    assert a == b
    assert a.rates_rps != c.rates_rps
    assert max(a.rates_rps) == pytest.approx(1000.0, rel=1e-12)
    calm = np.asarray(traces.diurnal(1000.0, bursts_per_day=0).rates_rps)
    ratio = np.asarray(a.rates_rps) / calm
    # Bursts multiply some steps by burst_factor relative to the rest (up to the common scaling).
    assert ratio.max() / ratio.min() == pytest.approx(1.5, rel=1e-9)
    assert a.notes["bursts"] == "20"
    assert traces.diurnal(1000.0, duration_s=43200.0).notes["bursts"] == "3"  # 6 a day, half a day


def test_flash_crowd_ramps_holds_and_drops_back():
    trace = traces.flash_crowd(10.0, factor=10.0, ramp_s=30.0, hold_s=60.0, before_s=20.0, after_s=40.0)
    rates = np.asarray(trace.rates_rps)
    assert trace.duration_s == 20 + 30 + 60 + 40
    assert rates[:20] == pytest.approx(10.0)
    assert rates[50:110] == pytest.approx(100.0)
    assert rates[35] == pytest.approx(10.0 + 90.0 * 15.5 / 30)  # the mean over second 35..36
    assert rates[-40:] == pytest.approx(10.0)
    assert np.all(np.diff(rates[20:50]) > 0)


def test_faults_are_added_in_time_order():
    trace = traces.with_faults(traces.steady(1.0, 100.0), traces.zone_lost(50.0), traces.replica_lost(10.0))
    assert [(f.at_s, f.kind) for f in trace.faults] == [(10.0, FaultKind.REPLICA_LOST), (50.0, FaultKind.ZONE_LOST)]
    with pytest.raises(ValueError, match="outside the trace"):
        traces.with_faults(trace, traces.replica_lost(500.0))


def test_scaled_multiplies_and_refuses_nonsense():
    assert traces.scaled(traces.steady(2.0, 3.0), 2.5).rates_rps == (5.0,) * 3
    with pytest.raises(ValueError):
        traces.scaled(traces.steady(2.0, 3.0), float("nan"))


def test_compressed_keeps_the_shape_and_the_mean():
    day = traces.with_faults(traces.diurnal(1000.0, bursts_per_day=0), traces.replica_lost(43200.0))
    hour = traces.compressed(day, 3600.0)
    assert hour.duration_s == pytest.approx(3600.0)
    assert len(hour.rates_rps) == 60
    assert np.mean(hour.rates_rps) == pytest.approx(np.mean(day.rates_rps), rel=1e-9)
    assert np.argmax(hour.rates_rps) == pytest.approx(np.argmax(day.rates_rps) / 24, abs=1)
    assert hour.faults[0].at_s == pytest.approx(1800.0)
    short = traces.compressed(traces.steady(3.0, 10.0), 5.0)
    assert short.rates_rps == (3.0,) * 5 and short.step_s == 1.0
    coarse = traces.compressed(traces.steady(3.0, 20.0, step_s=10.0), 4.0)  # under one old step: the step shrinks
    assert coarse.rates_rps == (3.0,) * 2 and coarse.step_s == 2.0


def write(tmp_path, name: str, content: str | bytes):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_a_csv_trace_is_resampled_to_its_smallest_gap(tmp_path):
    path = write(tmp_path, "t.csv", "time_s,rate_rps\n100,10\n102,20\n106,0\n")
    trace = traces.load_trace(path)
    assert trace.step_s == 2.0
    assert trace.rates_rps == (10.0, 20.0, 20.0, 0.0)


def test_a_csv_gap_under_a_second_is_averaged_into_one_second_steps(tmp_path):
    path = write(tmp_path, "t.csv", "time_s,rate_rps\n0,10\n0.5,30\n1,20\n")
    trace = traces.load_trace(path)
    assert trace.step_s == 1.0
    assert trace.rates_rps == (20.0, 20.0)


def test_a_json_trace_reads_as_is(tmp_path):
    path = write(tmp_path, "t.json", json.dumps({"step_s": 5, "rates_rps": [1, 2.5, 0], "name": "mine"}))
    trace = traces.load_trace(path)
    assert (trace.step_s, trace.rates_rps, trace.name) == (5.0, (1.0, 2.5, 0.0), "mine")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("time,rate\n0,1\n", "header"),
        ("", "empty"),
        ("time_s,rate_rps\n", "no rows"),
        ("time_s,rate_rps\n0,1\n1,nan\n", "line 3: rate_rps"),
        ("time_s,rate_rps\n0,1\n1,inf\n", "line 3: rate_rps"),
        ("time_s,rate_rps\n0,-1\n", "line 2: rate_rps"),
        ("time_s,rate_rps\n-5,1\n", "line 2: time_s"),
        ("time_s,rate_rps\n0,1\n5,1\n3,1\n", "line 4: .*sorted"),
        ("time_s,rate_rps\n0,1\n0,2\n", "line 3: .*sorted"),
        ("time_s,rate_rps\n0,1e12\n", "line 2: rate_rps"),
        ("time_s,rate_rps\n0,1,2\n", "line 2: expected 2 fields"),
        ("time_s,rate_rps\n0,abc\n", "line 2: not a number"),
        ("time_s,rate_rps\n1e300,1\n", "line 2: time_s"),
    ],
)
def test_hostile_csv_files_are_refused_by_line(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        traces.load_trace(write(tmp_path, "t.csv", content))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"step_s": 1, "rates_rps": [1, NaN]}', "NaN"),
        ('{"step_s": 1, "rates_rps": [1, -2]}', r"rates_rps\[1\]"),
        ('{"step_s": 1, "rates_rps": [1, true]}', r"rates_rps\[1\]: expected a number"),
        ('{"step_s": 0, "rates_rps": [1]}', "step_s"),
        ('{"step_s": 1, "rates_rps": []}', "non-empty"),
        ('{"step_s": 1, "rate_rps": [1]}', "unknown field"),
        ('{"step_s": 1, "rates_rps": [1e400]}', "finite"),
        ("[1, 2]", "expected an object"),
        ('{"step_s": 1, ', "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "JSON"),
    ],
)
def test_hostile_json_files_are_refused(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        traces.load_trace(write(tmp_path, "t.json", content))


def test_a_file_over_the_size_bound_is_refused_unread(tmp_path):
    path = tmp_path / "huge.csv"
    with path.open("wb") as handle:
        handle.truncate(traces.MAX_TRACE_FILE_BYTES + 1)  # sparse: no disk spent
    with pytest.raises(ValueError, match="bytes"):
        traces.load_trace(path)


def test_too_many_json_steps_are_refused(tmp_path):
    rates = ",".join(["0"] * (traces.MAX_TRACE_STEPS + 1))
    with pytest.raises(ValueError, match="more than"):
        traces.load_trace(write(tmp_path, "t.json", '{"step_s": 1, "rates_rps": [' + rates + "]}"))


def test_a_long_fine_csv_grows_its_step_to_stay_bounded(tmp_path):
    # Two rows a second apart, then one a billion seconds later: 1e9 one-second steps would be too many.
    path = write(tmp_path, "t.csv", "time_s,rate_rps\n0,1\n1,2\n1000000000,3\n")
    trace = traces.load_trace(path)
    assert len(trace.rates_rps) <= traces.MAX_TRACE_STEPS
    assert trace.step_s > 1000.0


def test_binary_garbage_and_a_missing_file_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="UTF-8"):
        traces.load_trace(write(tmp_path, "t.csv", b"\xff\xfe\x00garbage"))
    with pytest.raises(ValueError, match="cannot read"):
        traces.load_trace(tmp_path / "absent.csv")
