"""Where a worker's start went: spawn, import, load, warm-up; one log line per start.

Times come from both sides of the pipe on `time.monotonic()`, which is one system-wide clock on
Linux (CLOCK_MONOTONIC), so the frontend's "load requested" and the worker's "began" compare.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from servewell.workers.messages import WorkerReady

log = logging.getLogger("servewell.workers")


@dataclass(slots=True, frozen=True)
class ColdStartBreakdown:
    """One worker start, from the load's request to the worker ready, in seconds."""

    model: str
    instance: int
    pid: int | None
    spare: bool
    """Whether the worker was a spare (`workers/spare.py`) rather than a fresh spawn."""
    total_s: float
    """Requested until ready, as the frontend saw it."""
    spawn_s: float
    """Requested until the worker began on the model: process start, interpreter up, multiprocessing's
    re-import of the main module, unpickling the config (a spare: until it read the adoption)."""
    import_s: float
    """numpy, servewell's worker side and the runtime (onnxruntime, torch) imported."""
    load_s: float
    """The model read and its session built (weights, graph optimization), before warm-up."""
    warmup_s: float
    """Warm-up batches (and the precision check); 0 with `warmup: false`."""
    fresh_reason: str = ""
    """Why the worker was spawned fresh ("" for a spare): no spare idle, spares off, or the model
    needs a setting that only a fresh spawn gives."""
    loaded_at: str = "normal"
    """The CPU policy the load and warm-up ran at: "idle" (the server's `load_cpu_policy`, where
    it applies) or "normal"."""

    @property
    def other_s(self) -> float:
        """What the four steps leave out of `total_s` (messages, the frontend's own work)."""
        return max(0.0, self.total_s - self.spawn_s - self.import_s - self.load_s - self.warmup_s)

    def as_dict(self) -> dict[str, object]:
        """Plain values, rounded to the millisecond (logs, JSON)."""
        return {
            "model": self.model, "instance": self.instance, "pid": self.pid, "spare": self.spare,
            "total_s": round(self.total_s, 3), "spawn_s": round(self.spawn_s, 3),
            "import_s": round(self.import_s, 3), "load_s": round(self.load_s, 3),
            "warmup_s": round(self.warmup_s, 3), "other_s": round(self.other_s, 3),
            "fresh_reason": self.fresh_reason, "loaded_at": self.loaded_at,
        }


def breakdown_of(model: str, instance: int, info: WorkerReady, requested_at: float, ready_at: float,
                 spare: bool, fresh_reason: str = "") -> ColdStartBreakdown:
    """The breakdown of a start requested at `requested_at` that said `info` and was ready at
    `ready_at` (both `time.monotonic()`). A worker that did not say when it began counts
    everything before its load as spawn."""
    total_s = max(0.0, ready_at - requested_at)
    if info.began_at:
        spawn_s = max(0.0, info.began_at - requested_at)
        import_s, load_s = info.import_s, info.weights_s
    else:
        spawn_s, import_s, load_s = max(0.0, total_s - info.load_s - info.warmup_s), 0.0, info.load_s
    return ColdStartBreakdown(model, instance, info.pid, spare, total_s, spawn_s, import_s, load_s, info.warmup_s,
                              fresh_reason, info.loaded_at)


def log_breakdown(breakdown: ColdStartBreakdown) -> None:
    """One INFO line per worker start with the breakdown (event `worker_cold_start`)."""
    b = breakdown
    how = "spare worker" if b.spare else f"fresh worker ({b.fresh_reason})" if b.fresh_reason else "fresh worker"
    log.info("model %s instance %d: %s %s ready in %.2f s (spawn %.2f s, import %.2f s, load %.2f s, "
             "warm-up %.2f s; loaded at %s priority)", b.model, b.instance, how, b.pid, b.total_s, b.spawn_s,
             b.import_s, b.load_s, b.warmup_s, b.loaded_at, extra={"event": "worker_cold_start", **b.as_dict()})
