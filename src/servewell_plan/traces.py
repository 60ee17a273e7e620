"""Load shapes for the fleet simulators: steady, a day with bursts, a flash crowd, faults on top,
and the user's own trace file (CSV or JSON, read with hostile-input bounds).

Every function returns a `model.Trace`: a piecewise-constant Poisson rate on a fixed step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from servewell_plan.model import Fault, FaultKind, Trace

#: A trace file larger than this is refused before it is read.
MAX_TRACE_FILE_BYTES = 16 * 1024 * 1024
#: At most this many steps in a trace read from a file (a day at 0.1 s; the CSV step grows to fit).
MAX_TRACE_STEPS = 1_000_000
#: No rate above this (requests per second): far past any fleet, and well inside float precision.
MAX_RATE_RPS = 1e8
#: No time in a trace file beyond this (about 31 years).
MAX_TIME_S = 1e9
#: The smallest step a CSV trace is resampled to.
MIN_CSV_STEP_S = 1.0
CSV_HEADER = ("time_s", "rate_rps")
#: Where the day curve of `diurnal` peaks and bottoms out, in seconds after midnight.
DAY_PEAK_AT_S = 14 * 3600.0
DAY_S = 86400.0


def _steps(duration_s: float, step_s: float) -> int:
    if not (math.isfinite(duration_s) and duration_s > 0 and math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"need a positive duration and step, got {duration_s} s and {step_s} s")
    return max(1, math.ceil(duration_s / step_s - 1e-9))


def _check_rate(name: str, rate_rps: float) -> None:
    if not (math.isfinite(rate_rps) and 0 <= rate_rps <= MAX_RATE_RPS):
        raise ValueError(f"{name} must be within [0, {MAX_RATE_RPS:g}] req/s, got {rate_rps}")


def _trace(step_s: float, rates: np.ndarray, name: str, notes: dict[str, str]) -> Trace:
    return Trace(step_s=step_s, rates_rps=tuple(float(r) for r in rates), name=name, notes=notes)


def steady(rate_rps: float, duration_s: float, step_s: float = 1.0) -> Trace:
    """The same rate for `duration_s`."""
    _check_rate("rate_rps", rate_rps)
    n = _steps(duration_s, step_s)
    return _trace(step_s, np.full(n, float(rate_rps)), "steady", {"rate_rps": f"{rate_rps:g}"})


def diurnal(
    peak_rps: float,
    duration_s: float = DAY_S,
    step_s: float = 60.0,
    trough_share: float = 0.25,
    bursts_per_day: float = 6,
    burst_factor: float = 1.5,
    burst_s: float = 300.0,
    seed: int = 0,
) -> Trace:
    """A day of traffic: a raised cosine peaking at 14:00 and bottoming out at 02:00 (the trough at
    `trough_share` of the curve's peak), with `bursts_per_day` bursts (scaled to `duration_s` and
    rounded; each starting at a uniformly random time drawn from `seed`) multiplying the rate by
    `burst_factor` for `burst_s` each. Overlapping bursts do not compound (the larger factor holds).

    The whole trace, bursts included, is then scaled so that its busiest step is exactly `peak_rps`:
    `peak_rps` is what a fleet must carry at the worst moment, and the day curve's own peak sits
    `burst_factor` lower when a burst lands on it. The rate of each step is its mean over the step.
    """
    _check_rate("peak_rps", peak_rps)
    if not 0 <= trough_share <= 1:
        raise ValueError(f"trough_share must be within [0, 1], got {trough_share}")
    if not (burst_factor >= 1 and math.isfinite(burst_factor)) or burst_s < 0 or bursts_per_day < 0:
        raise ValueError("need burst_factor >= 1, burst_s >= 0 and bursts_per_day >= 0")
    n = _steps(duration_s, step_s)
    starts = np.arange(n) * step_s
    # The step mean of 0.5 * (1 + cos(w (t - peak))) is exact: integrate the cosine over the step.
    w = 2 * math.pi / DAY_S
    phase0, phase1 = w * (starts - DAY_PEAK_AT_S), w * (starts + step_s - DAY_PEAK_AT_S)
    cosine_mean = (np.sin(phase1) - np.sin(phase0)) / (w * step_s)
    day = trough_share + (1 - trough_share) * 0.5 * (1 + cosine_mean)
    rng = np.random.default_rng(seed)
    count = round(bursts_per_day * n * step_s / DAY_S) if burst_s > 0 else 0
    factor = np.ones(n)
    burst_starts = np.sort(rng.uniform(0.0, max(0.0, n * step_s - burst_s), size=count))
    for start in burst_starts:
        overlap = np.clip(np.minimum(starts + step_s, start + burst_s) - np.maximum(starts, start), 0, step_s) / step_s
        factor = np.maximum(factor, 1 + (burst_factor - 1) * overlap)
    rates = day * factor
    top = float(rates.max())
    rates = rates * (peak_rps / top) if top > 0 else rates * 0.0
    notes = {
        "peak_rps": f"{peak_rps:g}",
        "trough_share": f"{trough_share:g}",
        "bursts": str(count),
        "burst_factor": f"{burst_factor:g}",
        "burst_s": f"{burst_s:g}",
        "seed": str(seed),
        "burst_starts_s": " ".join(f"{s:.0f}" for s in burst_starts),
    }
    return _trace(step_s, rates, "diurnal", notes)


def flash_crowd(
    base_rps: float,
    factor: float = 10.0,
    ramp_s: float = 30.0,
    hold_s: float = 600.0,
    before_s: float = 300.0,
    after_s: float = 600.0,
    step_s: float = 1.0,
) -> Trace:
    """`base_rps` for `before_s`, a linear ramp to `factor` x base within `ramp_s`, `hold_s` there,
    then straight back to base (the crowd leaves at once) for `after_s`. Lasts
    before + ramp + hold + after."""
    _check_rate("base_rps", base_rps)
    _check_rate("the crowd's rate", base_rps * factor)
    if min(ramp_s, hold_s, before_s, after_s) < 0:
        raise ValueError("the phases of a flash crowd need durations >= 0")
    knots_t = np.cumsum([0.0, before_s, ramp_s, hold_s, 0.0, after_s])
    knots_r = np.array([1.0, 1.0, factor, factor, 1.0, 1.0]) * base_rps
    n = _steps(float(knots_t[-1]), step_s)
    # Step means of a piecewise-linear rate: difference its integral at the step edges.
    integral = np.concatenate(([0.0], np.cumsum(np.diff(knots_t) * (knots_r[1:] + knots_r[:-1]) / 2)))
    edges = np.arange(n + 1) * step_s
    cumulative = _integral_at(edges, knots_t, knots_r, integral)
    rates = np.diff(cumulative) / step_s
    notes = {
        "base_rps": f"{base_rps:g}",
        "factor": f"{factor:g}",
        "ramp_s": f"{ramp_s:g}",
        "hold_s": f"{hold_s:g}",
        "crowd_starts_s": f"{before_s:g}",
    }
    return _trace(step_s, rates, "flash_crowd", notes)


def _integral_at(t: np.ndarray, knots_t: np.ndarray, knots_r: np.ndarray, integral: np.ndarray) -> np.ndarray:
    """The integral of a piecewise-linear rate (knots, zero outside) from 0 to each `t`."""
    t = np.clip(t, knots_t[0], knots_t[-1])
    i = np.clip(np.searchsorted(knots_t, t, side="right") - 1, 0, len(knots_t) - 2)
    span = knots_t[i + 1] - knots_t[i]
    x = t - knots_t[i]
    slope = np.divide(knots_r[i + 1] - knots_r[i], span, out=np.zeros_like(span), where=span > 0)
    return integral[i] + knots_r[i] * x + slope * x * x / 2


def replica_lost(at_s: float) -> Fault:
    """One ready pod killed at `at_s` (a node failure)."""
    return Fault(at_s, FaultKind.REPLICA_LOST)


def zone_lost(at_s: float) -> Fault:
    """Every pod of zone 0 lost at `at_s`."""
    return Fault(at_s, FaultKind.ZONE_LOST)


def with_faults(trace: Trace, *faults: Fault) -> Trace:
    """The trace with `faults` added (kept in time order)."""
    for fault in faults:
        if not (math.isfinite(fault.at_s) and 0 <= fault.at_s <= trace.duration_s):
            raise ValueError(f"a fault at {fault.at_s} s is outside the trace (0 to {trace.duration_s:g} s)")
    return replace(trace, faults=tuple(sorted((*trace.faults, *faults), key=lambda f: f.at_s)))


def scaled(trace: Trace, factor: float) -> Trace:
    """Every rate multiplied by `factor`."""
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"the scale factor must be finite and >= 0, got {factor}")
    rates = np.asarray(trace.rates_rps) * factor
    _check_rate("the scaled peak", float(rates.max(initial=0.0)))
    return replace(trace, rates_rps=tuple(float(r) for r in rates), name=f"{trace.name} x{factor:g}")


def compressed(trace: Trace, duration_s: float) -> Trace:
    """The same shape played out over `duration_s` (a day in an hour, for a quick request-level run).

    Time shrinks by duration_s / trace.duration_s, rates stay rates: the trace keeps its step where
    that still leaves fewer steps than it had, each new step being the mean of the old steps it
    covers (a short burst flattens into its neighbours); otherwise the step shrinks with time.
    Faults move with time.
    """
    n_old = len(trace.rates_rps)
    if not (math.isfinite(duration_s) and duration_s > 0) or n_old == 0:
        raise ValueError(f"need a positive duration and a non-empty trace, got {duration_s} s")
    ratio = duration_s / trace.duration_s
    n_new = round(duration_s / trace.step_s)
    if n_new >= n_old or n_new < 1:
        step = duration_s / n_old
        rates = np.asarray(trace.rates_rps, dtype=float)
    else:
        step = duration_s / n_new
        rates = _step_means(np.arange(n_old + 1) * (trace.step_s * ratio), np.asarray(trace.rates_rps), step, n_new)
    faults = tuple(Fault(f.at_s * ratio, f.kind) for f in trace.faults)
    return replace(
        trace,
        step_s=step,
        rates_rps=tuple(float(r) for r in rates),
        faults=faults,
        name=f"{trace.name} in {duration_s:g} s",
    )


def _step_means(edges: np.ndarray, rates: np.ndarray, step_s: float, n: int) -> np.ndarray:
    """Resample a piecewise-constant rate (`rates[k]` from `edges[k]` to `edges[k + 1]`, zero
    after) to `n` steps of `step_s` from `edges[0]`: each step's mean rate (its requests / step_s)."""
    cumulative = np.concatenate(([0.0], np.cumsum(rates * np.diff(edges))))
    grid = edges[0] + np.arange(n + 1) * step_s
    return np.maximum(np.diff(np.interp(grid, edges, cumulative)) / step_s, 0.0)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """A user's trace file: CSV with the header `time_s,rate_rps` (each rate holds until the next
    row's time, the last for one step; times relative to the first row), or JSON
    `{"step_s": x, "rates_rps": [...]}` (optionally "name"). A file that breaks a rule or a bound
    raises ValueError naming the line or field.

    A CSV is resampled to a fixed step: the smallest gap between rows, at least 1 s, and larger if
    needed to keep the trace within MAX_TRACE_STEPS; each step gets its mean rate.
    """
    file = Path(path)
    try:
        size = file.stat().st_size
        if size > MAX_TRACE_FILE_BYTES:
            raise ValueError(f"{file}: {size} bytes, more than the {MAX_TRACE_FILE_BYTES} a trace file may have")
        with file.open("rb") as handle:
            raw = handle.read(MAX_TRACE_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{file}: cannot read the trace ({exc.strerror or exc})") from exc
    if len(raw) > MAX_TRACE_FILE_BYTES:
        raise ValueError(f"{file}: more than the {MAX_TRACE_FILE_BYTES} bytes a trace file may have")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not UTF-8 text (byte {exc.start})") from exc
    is_json = file.suffix.lower() == ".json" or (file.suffix.lower() != ".csv" and text.lstrip().startswith("{"))
    trace = _json_trace(text, file) if is_json else _csv_trace(text, file)
    return replace(trace, notes={**trace.notes, "file": file.name})


def _number(value: Any, where: str) -> float:
    # bool is an int in Python; a JSON true is not a number here.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{where}: not a finite number")
    return number


def _json_trace(text: str, file: Path) -> Trace:
    def refuse_constant(name: str) -> float:
        raise ValueError(f"{file}: {name} is not a number a trace may hold")

    try:
        document = json.loads(text, parse_constant=refuse_constant)
    except RecursionError as exc:
        raise ValueError(f"{file}: JSON nested too deeply") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(document, dict):
        raise ValueError(f'{file}: expected an object {{"step_s": ..., "rates_rps": [...]}}')
    unknown = sorted(set(document) - {"step_s", "rates_rps", "name"})
    if unknown:
        raise ValueError(f"{file}: unknown field(s) {', '.join(repr(k)[:40] for k in unknown[:5])}")
    if "step_s" not in document or "rates_rps" not in document:
        raise ValueError(f'{file}: needs "step_s" and "rates_rps"')
    step = _number(document["step_s"], f"{file}: step_s")
    if not 1e-3 <= step <= 1e6:
        raise ValueError(f"{file}: step_s must be within [0.001, 1e6] s, got {step}")
    rates = document["rates_rps"]
    if not isinstance(rates, list) or not rates:
        raise ValueError(f"{file}: rates_rps must be a non-empty list")
    if len(rates) > MAX_TRACE_STEPS:
        raise ValueError(f"{file}: {len(rates)} rates, more than the {MAX_TRACE_STEPS} a trace may have")
    values = np.empty(len(rates))
    for i, rate in enumerate(rates):
        values[i] = _number(rate, f"{file}: rates_rps[{i}]")
        if not 0 <= values[i] <= MAX_RATE_RPS:
            raise ValueError(f"{file}: rates_rps[{i}] = {values[i]:g} is outside [0, {MAX_RATE_RPS:g}]")
    name = document.get("name", file.stem)
    if not isinstance(name, str):
        raise ValueError(f"{file}: name must be a string")
    return _trace(step, values, name[:200], {})


def _csv_trace(text: str, file: Path) -> Trace:
    lines = text.splitlines()
    header = tuple(field.strip() for field in lines[0].split(",")) if lines else ()
    if header != CSV_HEADER:
        raise ValueError(
            f"{file}: line 1 must be the header {','.join(CSV_HEADER)}, got {lines[0][:80]!r}"
            if lines
            else f"{file}: empty file"
        )
    times: list[float] = []
    rates: list[float] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != 2:
            raise ValueError(f"{file}: line {number}: expected 2 fields (time_s,rate_rps), got {len(fields)}")
        try:
            t, rate = float(fields[0]), float(fields[1])
        except ValueError as exc:
            raise ValueError(f"{file}: line {number}: not a number: {line[:80]!r}") from exc
        if not (math.isfinite(t) and 0 <= t <= MAX_TIME_S):
            raise ValueError(f"{file}: line {number}: time_s must be within [0, {MAX_TIME_S:g}], got {fields[0][:40]}")
        if not (math.isfinite(rate) and 0 <= rate <= MAX_RATE_RPS):
            raise ValueError(
                f"{file}: line {number}: rate_rps must be within [0, {MAX_RATE_RPS:g}], got {fields[1][:40]}"
            )
        if times and t <= times[-1]:
            raise ValueError(
                f"{file}: line {number}: time_s {t:g} is not after the previous row's {times[-1]:g} "
                "(rows must be sorted by time, without repeats)"
            )
        times.append(t)
        rates.append(rate)
    if not times:
        raise ValueError(f"{file}: no rows after the header")
    start = np.asarray(times) - times[0]
    gaps = np.diff(start)
    step = max(MIN_CSV_STEP_S, float(gaps.min()) if gaps.size else MIN_CSV_STEP_S)
    span = float(start[-1]) + step  # the last row holds for one step
    if span / step > MAX_TRACE_STEPS:
        step = span / MAX_TRACE_STEPS
        span = float(start[-1]) + step
    n = min(MAX_TRACE_STEPS, max(1, math.ceil(span / step - 1e-9)))
    edges = np.append(start, start[-1] + step)
    values = _step_means(edges, np.asarray(rates), step, n)
    return _trace(step, values, file.stem[:200], {"rows": str(len(times))})
