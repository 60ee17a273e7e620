"""What one version's worker pool reports, turned into changes of its scheduler and its lifecycle
(`VersionSupervision`, the `PoolListener` of workers/pool.py): a worker that may take batches or
must not, the largest batch that fits, warm-up latencies, replacements counted, and the pool as a
whole serving again, restarting (no live worker) or given up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servewell.engine.model_lifecycle import stop_refusal
from servewell.errors import ShuttingDown, WorkerLost
from servewell.workers.handle import WorkerHandle
from servewell.workers.pool import PoolState, RestartReason, WarmupFacts

if TYPE_CHECKING:
    from servewell.engine.model_entry import ModelEntry
    from servewell.observability.metrics import ServeMetrics


class VersionSupervision:
    """The listener of one version's worker pool (`PoolListener`)."""

    __slots__ = ("_entry", "_metrics")

    def __init__(self, entry: ModelEntry, metrics: ServeMetrics | None) -> None:
        self._entry = entry
        self._metrics = metrics

    def worker_ready(self, worker: WorkerHandle) -> None:
        """A worker may take batches."""
        self._entry.scheduler.add_runner(worker)
        if self._entry.sequences is not None:  # a generative model's steps (engine/sequences.py)
            self._entry.sequences.add_runner(worker)

    def worker_gone(self, worker: WorkerHandle) -> None:
        """A worker died or is being drained."""
        self._entry.scheduler.remove_runner(worker)
        if self._entry.sequences is not None:
            self._entry.sequences.remove_runner(worker)

    def max_batch_size_limited(self, size: int, why: str) -> None:
        """Warm-up or an out-of-memory split lowered the largest batch that fits."""
        self._entry.scheduler.limits.limit_max_batch_size(size, why)

    def warmed_up(self, facts: WarmupFacts) -> None:
        """A worker's warm-up latencies (the compute budget's basis) and serving dtype."""
        self._entry.scheduler.limits.observe_warmup(facts.latency_by_batch)
        if facts.serving_dtype:
            self._entry.serving_dtype = facts.serving_dtype

    def worker_replaced(self, reason: RestartReason) -> None:
        """Count a replaced worker."""
        if self._metrics is not None:
            self._metrics.worker_restarts.labels(self._entry.name, reason).inc()

    def pool_state(self, state: PoolState, reason: str | None) -> None:
        """The pool is serving again, has no live worker, or gave up."""
        entry = self._entry
        life = entry.lifecycle
        if not life.supervised:
            return  # loading, stopped or failed: the load and stop paths own the phase
        if state == "ready":
            life.workers_back()
        elif state == "restarting":
            life.workers_lost(reason)
            if entry.pool.closing:  # stopping: nothing will come back to run what is queued
                cause = life.stop_cause
                refusal = stop_refusal(cause, entry.label) if cause else ShuttingDown("the server is shutting down")
                entry.scheduler.fail_all(type(refusal)(f"{entry.label} lost its last worker while it was stopping "
                                                       f"({reason}): {refusal.message}",
                                                       retry_after_s=refusal.retry_after_s))
        else:
            life.gave_up(reason)
            entry.fail_queued(WorkerLost(f"{entry.label} failed: {reason}"))
