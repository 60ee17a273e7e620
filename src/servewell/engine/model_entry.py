"""One served model version (`ModelEntry`): its lifecycle, and the scheduler and worker pool that
serve it, loaded and stopped as one. It is one `Entry` (engine/entry.py); a model whose
`model.yaml` is invalid is the other, `InvalidModel`, which has no scheduler or pool to be None.

Its parts each hold one job: the lifecycle (engine/model_lifecycle.py) says where the version is
and what that allows; the pool's reports become scheduler and lifecycle changes in
`VersionSupervision` (engine/version_supervision.py); what changes while it serves (live batching
settings, admin overrides, the response cache) is `VersionSettings` (engine/version_settings.py);
the private copy of its files is `VersionSnapshot` (engine/version_snapshot.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig
from servewell.engine.clock import Clock
from servewell.engine.full_lanes import FullLaneBoard
from servewell.engine.memory_budget import MemoryBudget, MemoryEstimate, estimate_model_memory
from servewell.engine.model_lifecycle import StopCause, VersionLifecycle, VersionPhase, not_ready
from servewell.engine.protocol import InstanceInfo, ModelState, ModelView, SchedulingFacts
from servewell.engine.repository import OutsidePolicy, outside_refusal
from servewell.engine.scheduler import ModelScheduler
from servewell.engine.sequences import SequenceScheduler
from servewell.engine.snapshot import SnapshotStore
from servewell.engine.tenants import Tenants
from servewell.engine.version_settings import VersionSettings
from servewell.engine.version_snapshot import VersionSnapshot
from servewell.engine.version_supervision import VersionSupervision
from servewell.errors import ServeError, WorkerLost
from servewell.observability.batch_telemetry import BatchTelemetry
from servewell.observability.metrics import ModelSample, ServeMetrics, WorkerSample
from servewell.observability.signals import ModelFacts
from servewell.observability.stream_telemetry import stream_telemetry
from servewell.observability.tracing import Tracing
from servewell.workers.handle import WorkerLoadError, WorkerSettings
from servewell.workers.pool import RESTART_REASONS, WorkerPool

log = logging.getLogger("servewell.engine")

#: (model, instance, stage, elapsed_s) while a worker loads.
LoadProgressFn = Callable[[str, int, str, float], None]


@dataclass(slots=True, frozen=True)
class EntryServices:
    """What every model entry of one engine shares."""

    load_timeout_s: float
    budget: MemoryBudget
    metrics: ServeMetrics | None = None
    tracing: Tracing | None = None
    on_progress: LoadProgressFn | None = None
    clock: Clock | None = None
    workers: WorkerSettings | None = None
    snapshots: SnapshotStore | None = None  # None: workers read the repository's files directly
    repository: Path | None = None  # the model repository, to notice a model directory that resolves outside it
    outside_repository: OutsidePolicy = "warn"  # `models_outside_repository`: warn (at the scan) or refuse
    #: Reserves a load's memory, evicting idle models first in lazy mode (engine/pool_memory.py);
    #: None: the budget's own reserve (refused when it does not fit).
    make_room: Callable[[ModelEntry, MemoryEstimate], Awaitable[None]] | None = None
    #: The server's tenants (engine/tenants.py): quotas per request, weights in the queue.
    tenants: Tenants | None = None
    #: Where the schedulers publish whom their full lanes refuse (engine/full_lanes.py): the door
    #: hands it on to the ingress processes, which refuse those requests before reading them.
    full_lanes: FullLaneBoard | None = None


class ModelEntry:
    """One version of a model: its lifecycle, its scheduler and its worker pool, loaded and stopped as one."""

    def __init__(self, name: str, directory: Path, config: ModelConfig, services: EntryServices) -> None:
        self.name = name
        self.directory = directory
        self.config = config
        self.lifecycle = VersionLifecycle()
        self.load_s: float | None = None
        self.serving_dtype: str | None = None  # what the workers compute in (dtype auto decides at warm-up)
        self._services = services
        metrics = services.metrics
        tracing = services.tracing if services.tracing is not None and services.tracing.enabled else None
        telemetry = BatchTelemetry(config.name, config.version, config.batching.lanes, metrics,
                                   tracing.tracer if tracing is not None else None)
        tenants = services.tenants
        board = services.full_lanes
        self.scheduler = ModelScheduler(config, telemetry, services.clock,
                                        tenants.weight if tenants is not None else None,
                                        board.publisher(name, config.version) if board is not None else None)
        self._telemetry = telemetry
        #: A generative model's sequences, run with continuous batching (engine/sequences.py); None otherwise.
        self.sequences = SequenceScheduler(config, services.clock, tenants.weight if tenants is not None else None,
                                           stream_telemetry(metrics)) if config.generate is not None else None
        self.settings = VersionSettings(self, metrics, services.clock)
        self.cache = self.settings.new_cache(config)
        self.snapshot = VersionSnapshot(name, self.label, directory, services.snapshots)
        progress = services.on_progress
        workers = services.workers or WorkerSettings()
        if tracing is None and workers.tracing is not None:
            workers = dataclasses.replace(workers, tracing=None)  # keeps the rest (the spare workers)
        self.pool = WorkerPool(
            config, directory, VersionSupervision(self, metrics), services.load_timeout_s, workers,
            (lambda i, stage, elapsed: progress(name, i, stage, elapsed)) if progress is not None else None,
        )
        if metrics is not None:  # series exist from the start, so increase() sees the first event
            for reason in RESTART_REASONS:
                metrics.worker_restarts.labels(name, reason)
            for result in ("success", "failure"):
                metrics.model_loads.labels(name, result)

    @property
    def version(self) -> str:
        """The version this entry serves."""
        return self.config.version

    @property
    def label(self) -> str:
        """How log lines and errors name this model version."""
        return f"model '{self.name}' version '{self.version}'"

    @property
    def state(self) -> ModelState:
        """The state users see (its lifecycle's)."""
        return self.lifecycle.state

    @property
    def reason(self) -> str | None:
        """Why it is not ready, when it is not."""
        return self.lifecycle.reason

    def count_outcome(self, lane: int) -> Callable[[str], None]:
        """Counts, per outcome, the requests of `lane` that the scheduler never sees (answered by
        the response cache, or sharing another request's computation)."""
        return partial(self._telemetry.count, lane)

    # --- the Entry interface (engine/entry.py) ---------------------------------------------

    def ready_entry(self) -> ModelEntry:
        """This entry if users see it ready; `ModelNotReady` with the reason otherwise (one being
        stopped still says ready: its lifecycle's `refusal` names how it is stopped)."""
        life = self.lifecycle
        if life.phase is not VersionPhase.READY and life.state != "ready":  # the first test: every request's
            raise not_ready(self.name, life.state, life.reason)
        return self

    def configurable(self) -> ModelEntry:
        """This entry: its settings may be read and changed (`VersionSettings` says when)."""
        return self

    def fail_all(self, error: ServeError) -> None:
        """Answer every queued and running request with `error` now."""
        self.scheduler.fail_all(error, running=True)
        if self.sequences is not None:
            self.sequences.fail_all(error)

    def fail_queued(self, error: ServeError) -> None:
        """The version lost its workers: queued requests and every sequence answered with `error`."""
        self.scheduler.fail_all(error)
        if self.sequences is not None:
            self.sequences.fail_all(error)

    def view(self) -> ModelView:
        """What the API shows of this version."""
        s = self.scheduler
        stats = s.stats
        scheduling = SchedulingFacts(s.queue_depth, s.lane_depths(), s.running_rows, s.limits.max_batch_size,
                                     stats.batches, stats.rows, stats.expired, stats.cancelled, stats.rejected,
                                     stats.isolated_batches)
        pool = self.pool
        return ModelView(self.name, self.version, self.state, self.reason, self.config, self.load_s,
                         pool.restarts, pool.recycles, self.instances(), scheduling, self.serving_dtype,
                         pool.last_failure)

    def sample(self) -> ModelSample:
        """State, queues and workers for a metrics scrape; a generative model's queue and in-flight
        figures are its waiting and running sequences (engine/sequences.py)."""
        sample = self._batches_sample()
        if self.sequences is None:
            return sample
        stats = self.sequences.stats()
        return dataclasses.replace(sample, lane_depths=self.sequences.lane_depths(),
                                   inflight=stats.running + stats.waiting)

    def _batches_sample(self) -> ModelSample:
        """State, queues and workers for a metrics scrape."""
        s = self.scheduler
        cache = self.cache
        return ModelSample(self.name, self.state, s.lane_depths(), s.queue_depth + s.running_rows,
                           s.limits.max_batch_size,
                           tuple(WorkerSample(self.name, i.instance, i.alive, i.pid) for i in self.instances()),
                           cache_bytes=cache.bytes if cache is not None else None,
                           cache_entries=cache.entries if cache is not None else 0)

    def facts(self) -> ModelFacts | None:
        """Queue fill, restarts and memory headroom, for the alert webhook."""
        fill = max(self.scheduler.lane_depths().values(), default=0) / self.scheduler.limits.batching.max_queue_size
        limit = self.config.host_memory_limit_bytes
        rss = max((i.rss_bytes for i in self.instances()), default=0)
        return ModelFacts(self.name, fill, self.pool.restarts + self.pool.recycles,
                          1.0 - rss / limit if limit else None)

    def report(self) -> dict[str, Any]:
        """The active config, when it was read, and admin overrides in force."""
        return {
            "state": self.state, "version": self.version, "file": str(self.directory / "model.yaml"),
            "loaded_at": self.settings.configured_at, "overrides": dict(self.settings.overrides),
            "batching": self.scheduler.limits.settings(), "config": self.config.model_dump(mode="json"),
            "cache": self.cache.report() if self.cache is not None else None,
        }

    def instances(self) -> tuple[InstanceInfo, ...]:
        """Per-instance process facts."""
        return tuple(
            InstanceInfo(i, w.pid if w else None, bool(w and w.alive), w.rss_bytes if w else 0,
                         w.rows_computed if w else 0, w.state if w else "starting", w.exit_reason if w else "",
                         w.load_attempt if w else 1, w.next_attempt_at if w else None)
            for i, w in enumerate(self.pool.workers)
        )

    # --- loading and stopping ------------------------------------------------------------------

    async def load(self) -> None:
        """Check the memory budget, snapshot the model directory, then start every instance; ready
        once all have warmed up. Stopped meanwhile: what it took is given back, the stop decides."""
        life = self.lifecycle
        life.loading()
        services = self._services
        why = outside_refusal(services.repository, self.directory, services.outside_repository) \
            if services.repository is not None else None
        if why:
            self._load_failed(f"refused before loading: {why}")
            return
        budget = services.budget
        try:
            estimate = estimate_model_memory(self.config, self.directory)
            if services.make_room is not None:
                await services.make_room(self, estimate)
            else:
                budget.reserve(self, estimate, self.label)
        except (MemoryError, OSError, ValueError) as exc:
            self._load_failed(f"refused before loading: {exc}")
            return
        started = time.perf_counter()
        private = self.directory
        try:
            if life.phase is not VersionPhase.LOADING:
                raise WorkerLoadError(f"{self.label} is stopping")  # a stop came while it waited for room
            private = await self.snapshot.take(self.config)
            await self.pool.start(private)
        except WorkerLoadError as exc:
            budget.release(self)
            await self.snapshot.release()
            self._load_failed(self.snapshot.explain(str(exc), private), "failed to load")
            return
        if life.phase is not VersionPhase.LOADING:
            return  # stopped as its last worker came up: the stop owns the phase
        if services.metrics is not None:
            services.metrics.model_loads.labels(self.name, "success").inc()
        self.load_s = time.perf_counter() - started
        life.loaded()
        log.info("%s ready in %.2f s", self.label, self.load_s, extra={"model": self.name})

    def _load_failed(self, reason: str, what: str = "not loaded") -> None:
        if self._services.metrics is not None:
            self._services.metrics.model_loads.labels(self.name, "failure").inc()
        if self.lifecycle.phase is VersionPhase.LOADING:  # else a stop came meanwhile: it owns the phase
            self.lifecycle.load_failed(reason)
        log.error("%s %s: %s", self.label, what, reason, extra={"model": self.name})

    def close(self) -> None:
        """The server is shutting down: restart no worker from now on (requests are still served)."""
        self.pool.close()

    async def stop(self, cause: StopCause, reason: str | None = None, worker_timeout_s: float = 5.0) -> None:
        """Drain queued and running requests, stop every worker, release the memory budget and the
        snapshot (an eviction keeps it: the next load links its unchanged files, so the reload reads
        weights the page cache still holds). Workers get `worker_timeout_s` to finish the batch in
        hand (0: killed at once). From now on new requests are refused with `cause`'s error.

        A failed version stays failed with its reason; otherwise it ends stopped, with `reason`."""
        life = self.lifecycle
        life.draining(cause)
        self.pool.close()  # a worker lost while draining is not replaced: its model's requests are answered
        if life.drains_queue:
            if self.pool.any_alive():
                await self.scheduler.drain()
                if self.sequences is not None:
                    await self.sequences.drain()
            else:
                self.fail_queued(WorkerLost(f"{self.label} has no running worker"))
        await self.pool.stop(worker_timeout_s)
        self._services.budget.release(self)
        if cause != "evicting":
            await self.snapshot.release()
        if self.cache is not None:
            self.cache.clear()  # its answers are this version's: memory back now, not when the entry is collected
        life.stopped(reason)

    async def release_snapshot(self) -> None:
        """Remove the snapshot an eviction kept (a later load has taken its own, or the server stops)."""
        await self.snapshot.release()
