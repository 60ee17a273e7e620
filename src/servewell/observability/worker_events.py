"""Worker replacements as events: each with its cause and the gap it caused.

A worker leaves service for one of three causes (`REASONS`): it died (`crash`: exit code, signal,
an out-of-memory kill), it stopped making progress (`hung`: no heartbeat, or a batch over its
compute budget; killed), or it grew past `host_memory_limit_bytes` (`memory`: drained, then
replaced; the pool used to call this a "recycle" and count it apart from restarts). All three are
restarts here, counted the same way in `/healthz` (`restarts`, `restarts_by_reason`), in
`servewell_worker_restarts_total{reason}` and in the alerts.

The *gap* of a replacement runs from the moment the old worker stopped taking batches to the
moment its replacement is ready. While other instances of the model serve (`others_serving` > 0)
the model runs on less capacity; with none (one instance, or all of them gone) every request of
the model waits the gap in its queue, or fails at its deadline: clients notice. The console and
the diagnosis (`diagnosis.py`) name the gap so that it is not read as slow batches or capacity.

The workers' pools (workers/pool.py) report through `WorkerEventSink`; the log is one per server,
in the engine, bounded (`CAPACITY` events), appended and read on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("servewell.workers")

#: Why a worker was replaced.
REASONS = ("crash", "hung", "memory")
#: Replacements kept one by one (the counts cover all of them).
CAPACITY = 200


class WorkerEventSink(Protocol):
    """What a worker pool reports about replacements (workers/pool.py)."""

    def left(self, model: str, version: str, instance: int, reason: str, detail: str, pid: int | None,
             others_serving: int) -> None:
        """A worker of `model` `version` `instance` stopped taking batches and will be replaced."""
        ...

    def back(self, model: str, version: str, instance: int, pid: int | None) -> None:
        """The instance's new worker is ready (a first start too: then nothing was open)."""
        ...


@dataclass(slots=True)
class Replacement:
    """One worker replacement."""

    model: str
    version: str
    instance: int
    reason: str  # crash, hung, memory
    detail: str  # the exit reason, why it was declared hung, or its memory against the limit
    at: float  # Unix time the old worker stopped taking batches
    pid: int | None  # the old worker's
    others_serving: int  # other instances of the model taking batches when it left
    gap_s: float | None = None  # until the replacement was ready (None: not yet)
    new_pid: int | None = None
    left_at: float = 0.0  # monotonic, for the gap

    @property
    def clients_waited(self) -> bool:
        """Whether no other instance served during the gap (the model's requests waited for it)."""
        return self.others_serving == 0

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """The event as `/healthz` and the console show it (`open_s`: how long an open one has run)."""
        doc: dict[str, Any] = {
            "model": self.model, "version": self.version, "instance": self.instance, "reason": self.reason,
            "detail": self.detail, "at": round(self.at, 3), "pid": self.pid, "new_pid": self.new_pid,
            "others_serving": self.others_serving, "clients_waited": self.clients_waited,
            "gap_s": None if self.gap_s is None else round(self.gap_s, 3),
        }
        if self.gap_s is None and now is not None:
            doc["open_s"] = round(max(0.0, now - self.left_at), 3)
        return doc


class WorkerEvents:
    """Every replacement of the server's workers: counts per model and cause since start, the latest
    `capacity` events, and the ones whose replacement is not ready yet."""

    def __init__(self, capacity: int = CAPACITY, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._events: deque[Replacement] = deque(maxlen=capacity)
        self._open: dict[tuple[str, str, int], Replacement] = {}
        self._counts: dict[str, dict[str, int]] = {}
        self._clock = clock
        self._wall_clock = wall_clock

    def left(self, model: str, version: str, instance: int, reason: str, detail: str, pid: int | None,
             others_serving: int) -> None:
        """Count one replacement of `reason` and open its gap (a second cause for an instance whose
        replacement is still open counts too, and the gap keeps running from the first)."""
        counts = self._counts.setdefault(model, dict.fromkeys(REASONS, 0))
        counts[reason] = counts.get(reason, 0) + 1
        key = (model, version, instance)
        if key in self._open:
            return
        event = Replacement(model, version, instance, reason, detail, self._wall_clock(), pid, others_serving,
                            left_at=self._clock())
        self._open[key] = event
        self._events.append(event)

    def back(self, model: str, version: str, instance: int, pid: int | None) -> None:
        """Close the instance's open replacement, if any, with its gap; one log line says it."""
        event = self._open.pop((model, version, instance), None)
        if event is None:
            return
        event.gap_s = max(0.0, self._clock() - event.left_at)
        event.new_pid = pid
        log.warning("model %s instance %d: worker %s replaced (%s: %s) by %s after a gap of %.2f s%s", model,
                    instance, event.pid, event.reason, event.detail, pid, event.gap_s,
                    "; no other instance served meanwhile" if event.clients_waited else "",
                    extra={"event": "worker_replaced", "model": model, "version": version, "instance": instance,
                           "reason": event.reason, "gap_s": round(event.gap_s, 3),
                           "others_serving": event.others_serving})

    def counts(self, model: str) -> dict[str, int]:
        """Replacements of `model`'s workers by cause since the server started (every cause present)."""
        return dict(self._counts.get(model, dict.fromkeys(REASONS, 0)))

    def total(self, model: str) -> int:
        """Replacements of `model`'s workers, every cause."""
        return sum(self._counts.get(model, {}).values())

    def recent(self, model: str | None = None, within_s: float | None = None) -> list[Replacement]:
        """The kept events, oldest first: of `model` only, and (`within_s`) those that began or were
        still open within the last `within_s` seconds."""
        now = self._clock()
        found = []
        for event in self._events:
            if model is not None and event.model != model:
                continue
            if within_s is not None:
                ended = event.left_at + event.gap_s if event.gap_s is not None else now
                if now - ended > within_s:
                    continue
            found.append(event)
        return found

    def to_json(self, model: str | None = None, within_s: float | None = None) -> list[dict[str, Any]]:
        """`recent` as JSON-ready dicts."""
        now = self._clock()
        return [e.to_json(now) for e in self.recent(model, within_s)]
