"""Slow-request warnings, one line each up to a rate, then one summary line per model and window.

One warning per slow request flooded the log under load: `make bench` wrote 4,345 of them in 5.5
minutes (the overload and saturation steps), burying the lines that matter and costing I/O when
the server was already saturated. Now a model's first `lines_per_window` slow requests of a
window are logged one by one, as before, and the rest are summed up at the window's end in one
line: how many, their p50 and p99, and the slowest few with their request ids, stages and batch
facts (exemplars to look up). A trickle (fewer than `lines_per_window` in `window_s`) still logs
every request; a flood logs at most `lines_per_window + 1` lines per model and window (6 per 10
s by default: under 200 lines where `make bench` wrote 4,345). Failed requests keep their own
lines (`api/errors.py`; refusals are summed up by `refusal_log.py`); the metrics stay exact.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from servewell.observability.refusal_log import Scheduler, loop_call_later

if TYPE_CHECKING:  # only its attributes are read: no import cycle at run time
    from servewell.observability.recent_requests import RequestRecord

#: A window's length: prompt enough for an operator watching the log, few lines under load.
WINDOW_S = 10.0
#: Slow requests logged one by one per model and window before they are only summed up.
LINES_PER_WINDOW = 5
#: The slowest requests a summary names.
WORST_KEPT = 3
#: Durations kept per window for the summary's p50/p99: exact up to this many, a uniform
#: sample (reservoir) beyond, so a window's memory stays bounded whatever the flood.
SAMPLE_SIZE = 1024


def record_fields(record: RequestRecord) -> dict[str, Any]:
    """What a log line says of one slow request: its id, route, status, total and stages, and
    where it ran (the batch facts known)."""
    fields: dict[str, Any] = {"request_id": record.request_id, "route": record.route, "status": record.status,
                              "total_ms": record.total_ms, "stages_ms": record.stages_ms}
    for name in ("batch_id", "batch_size", "instance", "queue_position"):
        value = getattr(record, name)
        if value is not None:
            fields[name] = value
    return fields


@dataclass(slots=True)
class _Window:
    logged: int = 0
    suppressed: int = 0
    sample: list[float] = field(default_factory=list)
    worst: list[tuple[float, int, RequestRecord]] = field(default_factory=list)  # a min-heap of the slowest


class SlowRequestLog:
    """Logs slow requests, at most `lines_per_window` a model per window and a summary of the rest."""

    def __init__(self, logger: logging.Logger, window_s: float = WINDOW_S, lines_per_window: int = LINES_PER_WINDOW,
                 worst_kept: int = WORST_KEPT, schedule: Scheduler | None = None,
                 sample_size: int = SAMPLE_SIZE) -> None:
        if window_s <= 0 or lines_per_window < 0 or worst_kept < 1 or sample_size < 1:
            raise ValueError("need window_s > 0, lines_per_window >= 0, worst_kept >= 1, sample_size >= 1")
        self._log = logger
        self.window_s = window_s
        self.lines_per_window = lines_per_window
        self._worst_kept = worst_kept
        self._schedule = schedule
        self._sample_size = sample_size
        self._open: dict[str, _Window] = {}  # by model: bounded by the server's models (and "")
        self._seq = itertools.count()
        self._random = random.Random(0)  # the reservoir's choices: reproducible, not secret

    def slow(self, record: RequestRecord) -> None:
        """One slow request: logged now while its model's window has lines left, else summed up."""
        window = self._open.get(record.model)
        if window is None:
            window = self._open[record.model] = _Window()
            schedule = self._schedule or loop_call_later
            schedule(self.window_s, lambda: self._flush(record.model))
        if window.logged < self.lines_per_window:
            window.logged += 1
            self._log.warning("slow request: %.1f ms on %s (status %d)", record.total_ms, record.route, record.status,
                              extra=record_fields(record))
            return
        window.suppressed += 1
        if len(window.sample) < self._sample_size:
            window.sample.append(record.total_ms)
        else:
            slot = self._random.randrange(window.suppressed)
            if slot < self._sample_size:
                window.sample[slot] = record.total_ms
        entry = (record.total_ms, next(self._seq), record)
        if len(window.worst) < self._worst_kept:
            heapq.heappush(window.worst, entry)
        elif entry[0] > window.worst[0][0]:
            heapq.heapreplace(window.worst, entry)

    def flush_all(self) -> None:
        """Log every open window's summary now (at shutdown, or in tests)."""
        for model in list(self._open):
            self._flush(model)

    def _flush(self, model: str) -> None:
        window = self._open.pop(model, None)
        if window is None or not window.suppressed:
            return
        ordered = sorted(window.sample)
        p50, p99 = _nearest_rank(ordered, 0.5), _nearest_rank(ordered, 0.99)
        worst = [record for _, _, record in sorted(window.worst, key=lambda e: (-e[0], e[1]))]
        named = "; ".join(f"{r.request_id} {r.total_ms:.1f} ms ({_stages(r)})" for r in worst)
        self._log.warning(
            "slow requests: %d more of model %s in %g s not logged one by one; p50 %.1f ms, p99 %.1f ms; "
            "slowest: %s", window.suppressed, model or "-", self.window_s, p50, p99, named,
            extra={"model": model or None, "suppressed": window.suppressed, "logged": window.logged,
                   "window_s": self.window_s, "p50_ms": p50, "p99_ms": p99,
                   "worst": [record_fields(r) for r in worst]},
        )


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _stages(record: RequestRecord) -> str:
    stages = ", ".join(f"{name} {ms:.1f}" for name, ms in record.stages_ms.items())
    batch = "" if record.batch_id is None else f"batch {record.batch_id} of {record.batch_size} on #{record.instance}"
    return "; ".join(part for part in (stages, batch) if part) or "no stages"
