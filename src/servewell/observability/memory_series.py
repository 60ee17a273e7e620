"""Memory over time, per process: the engine, each ingress process, each worker, each labelled.

One figure, one definition, everywhere: **resident set size (RSS)**, read from `/proc/PID/statm`
(resident pages times the page size), the same number a worker's `host_memory_limit_bytes` is
checked against. The console's charts, `/healthz`'s `processes` and
`servewell_process_resident_memory_bytes{process}` all show it, named by process:

- `engine`: the engine process (in the single-process server, the one process: its name is still
  `engine`, and there is no ingress line);
- `ingress N`: ingress process N, as its own snapshot last reported it (at most a few seconds old);
- `worker MODEL vVERSION #I`: instance I of a model version (a replaced worker keeps the name: its
  series drops and starts again, the sawtooth of a leak; the pid says which process it was).

Every `interval_s` the console feed hands the latest readings to `MemorySeries.sample`; points older
than `window_s` fall off and a process not seen for a window is forgotten, so memory is bounded
by (processes x window / interval) points. `growth` fits a line (least squares) through the
points of the process's current pid, at least `MIN_POINTS` over `MIN_SPAN_S`; with a limit, the
time left to it follows (`seconds_to_limit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: How every memory figure of the server is defined (the console and /healthz say it beside the numbers).
DEFINITION = "resident set size (RSS, /proc/PID/statm), per process"
#: Points a growth rate needs, and the time they must span, before it is given.
MIN_POINTS = 4
MIN_SPAN_S = 10.0
#: At most this many processes are followed (the engine and ingress processes first).
MAX_PROCESSES = 128


@dataclass(slots=True, frozen=True)
class ProcessMemory:
    """One process's resident memory now."""

    name: str  # engine, ingress N, worker MODEL vVERSION #I
    role: str  # engine, ingress, worker
    pid: int | None
    rss_bytes: int
    limit_bytes: int | None = None  # a worker's host_memory_limit_bytes
    model: str | None = None
    instance: int | None = None


def worker_name(model: str, version: str, instance: int) -> str:
    """How a worker is named in the series, in /healthz and in its process title."""
    return f"worker {model} v{version} #{instance}" if version else f"worker {model} #{instance}"


def growth_rate(points: Iterable[tuple[float, float]]) -> float | None:
    """Bytes per second by least squares over `(t, bytes)` points (None: fewer than `MIN_POINTS`, or
    spanning less than `MIN_SPAN_S`)."""
    pts = list(points)
    if len(pts) < MIN_POINTS or pts[-1][0] - pts[0][0] < MIN_SPAN_S:
        return None
    n = len(pts)
    mean_t = sum(t for t, _ in pts) / n
    mean_v = sum(v for _, v in pts) / n
    var = cov = 0.0
    for t, v in pts:
        dt = t - mean_t
        var += dt * dt
        cov += dt * (v - mean_v)
    return cov / var if var > 0 else None


def _to_limit(series: _Series, rate: float | None) -> float | None:
    if series.limit_bytes is None or rate is None or rate <= 0 or not series.points:
        return None
    return max(0.0, (series.limit_bytes - series.points[-1][1]) / rate)


class _Series:
    __slots__ = ("name", "role", "model", "instance", "points", "limit_bytes", "seen_at", "growth", "growth_of")

    def __init__(self, reading: ProcessMemory, keep: int) -> None:
        self.name, self.role, self.model, self.instance = reading.name, reading.role, reading.model, reading.instance
        self.points: deque[tuple[float, int, int | None]] = deque(maxlen=keep)  # (t, rss, pid)
        self.limit_bytes = reading.limit_bytes
        self.seen_at = 0.0
        self.growth: float | None = None  # of the points up to `growth_of` (the time of the newest)
        self.growth_of = -1.0


class MemorySeries:
    """The processes' resident memory over the last `window_s`, one point per `interval_s`."""

    def __init__(self, interval_s: float = 2.0, window_s: float = 300.0, max_processes: int = MAX_PROCESSES) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError("need 0 < interval_s <= window_s")
        self.interval_s = interval_s
        self.window_s = window_s
        self._keep = int(window_s // interval_s)
        self._max = max_processes
        self._series: dict[str, _Series] = {}

    def sample(self, at: float, readings: Iterable[ProcessMemory]) -> None:
        """Add each reading as a point at Unix time `at` (a process gone for a window is forgotten)."""
        for reading in sorted(readings, key=lambda r: (r.role != "engine", r.role != "ingress", r.name)):
            series = self._series.get(reading.name)
            if series is None:
                if len(self._series) >= self._max:
                    continue
                series = self._series[reading.name] = _Series(reading, self._keep)
            series.points.append((round(at, 3), reading.rss_bytes, reading.pid))
            series.limit_bytes = reading.limit_bytes
            series.seen_at = at
        for name in [n for n, s in self._series.items() if at - s.seen_at > self.window_s]:
            del self._series[name]

    def names(self) -> list[str]:
        """The processes followed, engine first, then ingress processes, then workers."""
        return [s.name for s in self._ordered()]

    def _ordered(self) -> list[_Series]:
        order = {"engine": 0, "ingress": 1, "worker": 2}
        return sorted(self._series.values(), key=lambda s: (order.get(s.role, 3), s.name))

    def growth(self, name: str) -> float | None:
        """Bytes per second the process `name` grows by, over its current pid's points in the window."""
        series = self._series.get(name)
        if series is None or not series.points:
            return None
        newest, _, pid = series.points[-1]
        if series.growth_of != newest:  # once per sample: every reader of the tick shares it
            series.growth = growth_rate([(t, rss) for t, rss, p in series.points if p == pid])
            series.growth_of = newest
        return series.growth

    def seconds_to_limit(self, name: str) -> float | None:
        """When the process reaches its limit at its growth rate (None: no limit, not growing)."""
        series = self._series.get(name)
        return _to_limit(series, self.growth(name)) if series is not None else None

    def latest(self) -> list[dict[str, Any]]:
        """Each process now: name, role, pid, RSS, limit, growth per second and seconds to the limit."""
        rows = []
        for series in self._ordered():
            if not series.points:
                continue
            _, rss, pid = series.points[-1]
            growth = self.growth(series.name)
            to_limit = _to_limit(series, growth)
            rows.append({"name": series.name, "role": series.role, "pid": pid, "rss_bytes": rss,
                         "limit_bytes": series.limit_bytes, "model": series.model, "instance": series.instance,
                         "growth_bytes_per_s": None if growth is None else round(growth, 1),
                         "seconds_to_limit": None if to_limit is None else round(to_limit, 1)})
        return rows

    def to_json(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The console's memory view: the latest rows and each process's points as columns
        (`t`, `rss_bytes`, `pid`), oldest first; only `names` when given."""
        wanted = None if names is None else set(names)
        series = []
        for s in self._ordered():
            if wanted is not None and s.name not in wanted:
                continue
            points = s.points
            series.append({"name": s.name, "t": [p[0] for p in points], "rss_bytes": [p[1] for p in points],
                           "pid": [p[2] for p in points]})
        rows = [row for row in self.latest() if wanted is None or row["name"] in wanted]
        return {"definition": DEFINITION, "interval_s": self.interval_s, "window_s": self.window_s,
                "processes": rows, "series": series}
