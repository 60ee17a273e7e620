"""One served model version: its scheduler, its worker pool and the truth about its state.

The pool (workers/pool.py) supervises the processes and reports through `PoolListener`; this
class turns those reports into scheduler changes and into the model's state, which has one
setter. It is one `Entry` (engine/entry.py); a model whose `model.yaml` is invalid is the other,
`InvalidModel`, which has no scheduler or pool to be None.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig
from servewell.engine.clock import Clock
from servewell.engine.entry import StopCause, not_ready
from servewell.engine.full_lanes import FullLaneBoard
from servewell.engine.memory_budget import MemoryBudget, MemoryEstimate, estimate_model_memory
from servewell.engine.model_files import model_files, unlisted_files
from servewell.engine.protocol import InstanceInfo, ModelState, ModelView, SchedulingFacts
from servewell.engine.repository import OutsidePolicy, outside_refusal
from servewell.engine.response_cache import ResponseCache
from servewell.engine.scheduler import ModelScheduler
from servewell.engine.sequences import SequenceScheduler
from servewell.engine.snapshot import Snapshot, SnapshotError, SnapshotStore
from servewell.engine.tenants import Tenants
from servewell.errors import (
    Conflict,
    ModelLoading,
    ModelReloading,
    ModelUnloading,
    ServeError,
    ShuttingDown,
    Unavailable,
    WorkerLost,
)
from servewell.observability.batch_telemetry import BatchTelemetry
from servewell.observability.metrics import ModelSample, ServeMetrics, WorkerSample
from servewell.observability.signals import ModelFacts
from servewell.observability.stream_telemetry import stream_telemetry
from servewell.observability.tracing import Tracing
from servewell.workers.handle import WorkerHandle, WorkerLoadError, WorkerSettings
from servewell.workers.pool import RESTART_REASONS, PoolState, RestartReason, WarmupFacts, WorkerPool

log = logging.getLogger("servewell.engine")

#: (model, instance, stage, elapsed_s) while a worker loads.
LoadProgressFn = Callable[[str, int, str, float], None]

#: Retry-After of a request refused by a version that is being replaced: the new version serves now.
RELOADING_RETRY_S = 1.0
#: Retry-After of a request refused by a model being unloaded: it comes back only when loaded again.
UNLOADING_RETRY_S = 5.0


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
    #: Reserves a load's memory, evicting idle models first in lazy mode (engine/model_pool.py);
    #: None: the budget's own reserve (refused when it does not fit).
    make_room: Callable[[ModelEntry, MemoryEstimate], Awaitable[None]] | None = None
    #: The server's tenants (engine/tenants.py): quotas per request, weights in the queue.
    tenants: Tenants | None = None
    #: Where the schedulers publish whom their full lanes refuse (engine/full_lanes.py): the door
    #: hands it on to the ingress processes, which refuse those requests before reading them.
    full_lanes: FullLaneBoard | None = None


class ModelEntry:
    """One version of a model: scheduler + worker pool + state."""

    def __init__(self, name: str, directory: Path, config: ModelConfig, services: EntryServices) -> None:
        self.name = name
        self.directory = directory
        self.config = config
        self.state: ModelState = "unloaded"
        self.reason: str | None = None
        self.load_s: float | None = None
        self.serving_dtype: str | None = None  # what the workers compute in (dtype auto decides at warm-up)
        self._snapshot: Snapshot | None = None
        self.configured_at = time.time()  # when `config` was read from model.yaml (wall clock)
        self.overrides: dict[str, object] = {}  # batching settings an admin PATCH changed since then
        self.stopping: StopCause | None = None  # set once this version takes no new request
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
        self.cache = self._new_cache(config)
        progress = services.on_progress
        workers = services.workers or WorkerSettings()
        if tracing is None and workers.tracing is not None:
            workers = dataclasses.replace(workers, tracing=None)  # keeps the rest (the spare workers)
        self.pool = WorkerPool(
            config, directory, self, services.load_timeout_s, workers,
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

    def apply_batching(self, config: ModelConfig) -> dict[str, object]:
        """Take a new model.yaml whose only changes are live settings (batching, a max batch size
        within what warm-up proved, the response cache): the file's values apply, admin overrides
        end, and the response cache starts empty (a changed config may change the answers). Returns
        the overrides that were dropped."""
        self.scheduler.update({**config.batching.model_dump(exclude={"lanes"}),
                               "max_batch_size": max(1, config.max_batch_size)})
        dropped, self.overrides = self.overrides, {}
        self.config, self.configured_at = config, time.time()
        self.cache = self._new_cache(config)
        return dropped

    def _new_cache(self, config: ModelConfig) -> ResponseCache | None:
        if config.cache is None or not config.deterministic:
            return None
        return ResponseCache(self.name, config.cache, self._services.metrics, self._services.clock,
                             version=config.version)

    def count_outcome(self, lane: int) -> Callable[[str], None]:
        """Counts, per outcome, the requests of `lane` that the scheduler never sees (answered by
        the response cache, or sharing another request's computation)."""
        return partial(self._telemetry.count, lane)

    def update_batching(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """An admin's live change of batching settings (all or nothing); a None value returns that
        setting to model.yaml's value and ends its override. `Conflict` (409) once the model is
        unloaded, failed or stopping: its settings would apply to nothing."""
        if self.stopping is not None or self.state not in ("loading", "ready", "restarting"):
            state = self.state if self.state not in ("loading", "ready", "restarting") else self.stopping
            raise Conflict(f"{self.label} is {state}: its batching settings cannot change (load it through the "
                           "repository API first)")
        resolved = {key: self._file_value(key) if value is None else value for key, value in changes.items()}
        settings = self.scheduler.update(resolved)
        for key, value in changes.items():
            if value is None:
                self.overrides.pop(key, None)
            else:
                self.overrides[key] = value
        return settings

    def _file_value(self, key: str) -> object:
        """What model.yaml gives a live setting (the built-in default when the file sets none)."""
        if key == "max_batch_size":
            return min(max(1, self.config.max_batch_size), self.scheduler.limits.proven_max_batch_size)
        return getattr(self.config.batching, key)

    def refusal(self) -> Unavailable | None:
        """Why this version refuses a new request while it stops (None while it takes them)."""
        if self.stopping == "unloading":
            return ModelUnloading(f"{self.label} is being unloaded by an operator and takes no new requests",
                                  retry_after_s=UNLOADING_RETRY_S)
        if self.stopping == "reloading":
            return ModelReloading(f"{self.label} is being replaced by a reload; retry: the new version serves",
                                  retry_after_s=RELOADING_RETRY_S)
        if self.stopping == "shutting_down":
            return ShuttingDown("the server is shutting down and accepts no new requests")
        if self.stopping == "removing":
            return ModelUnloading(f"{self.label}: its files were removed from the repository; it takes no new "
                                  "requests", retry_after_s=None)
        if self.stopping == "evicting":
            return ModelLoading(f"{self.label} is being evicted to make room; it loads again on a request",
                                retry_after_s=UNLOADING_RETRY_S)
        return None

    def live_changes_only(self, config: ModelConfig) -> bool:
        """Whether `config` differs from the serving one only in what applies without new workers:
        batching settings other than lanes, a max batch size within the proven maximum, and the
        model pool's `pinned` and `idle_unload_s`."""
        if config.batching.lanes != self.config.batching.lanes:
            return False
        if config.max_batch_size > self.scheduler.limits.proven_max_batch_size or (config.max_batch_size == 0) != (
                self.config.max_batch_size == 0):
            return False
        # The pool reads pinned and idle_unload_s per use; the cache is rebuilt by apply_batching.
        same = {"batching", "max_batch_size", "pinned", "idle_unload_s", "cache", "deterministic", "traffic", "rollout"}
        return config.model_dump(exclude=same) == self.config.model_dump(exclude=same)

    # --- the Entry interface (engine/entry.py) ---------------------------------------------

    def ready_entry(self) -> ModelEntry:
        """This entry if it is ready; `ModelNotReady` with the reason otherwise."""
        if self.state != "ready":
            raise not_ready(self.name, self.state, self.reason)
        return self

    def configurable(self) -> ModelEntry:
        """This entry: its settings may be read and changed."""
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
        return ModelView(self.name, self.version, self.state, self.reason, self.config, self.load_s,
                         self.restarts, self.recycles, self.instances(), scheduling, self.serving_dtype,
                         self.last_failure)

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
        return ModelFacts(self.name, fill, self.restarts + self.recycles, 1.0 - rss / limit if limit else None)

    def report(self) -> dict[str, Any]:
        """The active config, when it was read, and admin overrides in force."""
        return {
            "state": self.state, "version": self.version, "file": str(self.directory / "model.yaml"),
            "loaded_at": self.configured_at, "overrides": dict(self.overrides),
            "batching": self.scheduler.limits.settings(), "config": self.config.model_dump(mode="json"),
            "cache": self.cache.report() if self.cache is not None else None,
        }

    def _set_state(self, state: ModelState, reason: str | None = None) -> None:
        """The one place the state changes."""
        self.state, self.reason = state, reason

    def instances(self) -> tuple[InstanceInfo, ...]:
        """Per-instance process facts."""
        return tuple(
            InstanceInfo(i, w.pid if w else None, bool(w and w.alive), w.rss_bytes if w else 0,
                         w.rows_computed if w else 0, w.state if w else "starting", w.exit_reason if w else "",
                         w.load_attempt if w else 1, w.next_attempt_at if w else None)
            for i, w in enumerate(self.pool.workers)
        )

    @property
    def last_failure(self) -> str | None:
        """The last worker failure (exit code or signal, or why it was declared hung)."""
        return self.pool.last_failure

    @property
    def restarts(self) -> int:
        """Workers restarted after dying."""
        return self.pool.restarts

    @property
    def recycles(self) -> int:
        """Workers replaced for using too much memory."""
        return self.pool.recycles

    async def load(self) -> None:
        """Check the memory budget, snapshot the model directory, then start every instance; ready
        once all have warmed up."""
        self._set_state("loading")
        refused = self._outside_refusal()
        if refused is not None:
            self._count_load(False)
            self._set_state("failed", refused)
            log.error("%s not loaded: %s", self.label, self.reason, extra={"model": self.name})
            return
        budget = self._services.budget
        try:
            estimate = estimate_model_memory(self.config, self.directory)
            if self._services.make_room is not None:
                await self._services.make_room(self, estimate)
            else:
                budget.reserve(self, estimate, self.label)
        except (MemoryError, OSError, ValueError) as exc:
            self._count_load(False)
            self._set_state("failed", f"refused before loading: {exc}")
            log.error("%s not loaded: %s", self.label, self.reason, extra={"model": self.name})
            return
        started = time.perf_counter()
        private = self.directory
        try:
            private = await self._private_directory()
            await self.pool.start(private)
        except WorkerLoadError as exc:
            self._count_load(False)
            reason = str(exc)
            if private != self.directory:
                unlisted = unlisted_files(reason, private, self.directory)
                if unlisted:
                    reason += (f" ({', '.join(unlisted)}: in the model directory but not in its snapshot, which "
                               "copies only the files the model is known to use; list them in model.yaml's "
                               "extra_files)")
            # The workers loaded the snapshot; the operator knows the files by their repository path.
            self._set_state("failed", reason.replace(str(private), str(self.directory)))
            budget.release(self)
            await self._release_snapshot()
            log.error("%s failed to load: %s", self.label, self.reason, extra={"model": self.name})
            return
        self._count_load(True)
        self.load_s = time.perf_counter() - started
        self._set_state("ready")
        log.info("%s ready in %.2f s", self.label, self.load_s, extra={"model": self.name})

    def _outside_refusal(self) -> str | None:
        """Why the model is refused for resolving outside the repository (None: it may load)."""
        services = self._services
        if services.repository is None:
            return None
        why = outside_refusal(services.repository, self.directory, services.outside_repository)
        return f"refused before loading: {why}" if why else None

    async def _private_directory(self) -> Path:
        """The server's own copy of the model directory for the workers to load (see `snapshot`); the
        repository's directory itself when snapshots are off or cannot be made."""
        store = self._services.snapshots
        if store is None:
            return self.directory

        def take() -> Snapshot:  # the files of the very config being loaded
            return store.take(self.directory, f"{self.name}-{self.version}", model_files(self.config, self.directory))

        try:
            snapshot = await asyncio.get_running_loop().run_in_executor(store.executor, take)
        except SnapshotError as exc:
            log.error("%s: %s; its workers read the repository's files directly, so overwriting them in place "
                      "can crash them", self.label, exc, extra={"model": self.name})
            return self.directory
        self._snapshot = snapshot
        log.info("%s: snapshot of %d files in %.3f s (%d MiB copied, %d MiB unchanged and linked)", self.label,
                 snapshot.files, snapshot.seconds, snapshot.copied_bytes >> 20, snapshot.reused_bytes >> 20,
                 extra={"model": self.name, "snapshot": str(snapshot.directory)})
        return snapshot.directory

    async def _release_snapshot(self) -> None:
        store, snapshot = self._services.snapshots, self._snapshot
        self._snapshot = None
        if store is not None and snapshot is not None:
            await asyncio.get_running_loop().run_in_executor(store.executor, store.release, snapshot)

    async def profile(self, instance: int, seconds: float, directory: str) -> str:
        """Profile one instance's batches for `seconds`; the trace file's path."""
        return await self.pool.profile(instance, seconds, directory)

    def close(self) -> None:
        """The server is shutting down: restart no worker from now on (requests are still served)."""
        self.pool.close()

    async def stop(self, cause: StopCause, state: ModelState = "unloaded", reason: str | None = None,
                   worker_timeout_s: float = 5.0) -> None:
        """Drain queued and running requests, stop every worker, release the memory budget and the
        snapshot. Workers get `worker_timeout_s` to finish the batch in hand (0: killed at once).
        From now on new requests are refused with `cause`'s error (`refusal`).

        A failed model keeps its state and reason; otherwise the entry ends in `state`."""
        self.stopping = self.stopping or cause
        self.pool.close()  # a worker lost while draining is not replaced: its model's requests are answered
        if self.state in ("ready", "restarting"):
            if self.pool.any_alive():
                await self.scheduler.drain()
                if self.sequences is not None:
                    await self.sequences.drain()
            else:
                self.fail_queued(WorkerLost(f"{self.label} has no running worker"))
        await self.pool.stop(worker_timeout_s)
        self._services.budget.release(self)
        if cause != "evicting":
            # An evicted model keeps its snapshot until it loads again: the next snapshot hard-links
            # its unchanged files, so the reload reads weights the page cache still holds.
            await self._release_snapshot()
        if self.cache is not None:
            self.cache.clear()  # its answers are this version's: memory back now, not when the entry is collected
        if self.state != "failed":
            self._set_state(state, reason)

    async def release_snapshot(self) -> None:
        """Remove the snapshot an eviction kept (a later load has taken its own, or the server stops)."""
        await self._release_snapshot()

    def _count_load(self, ok: bool) -> None:
        if self._services.metrics is not None:
            self._services.metrics.model_loads.labels(self.name, "success" if ok else "failure").inc()

    # --- PoolListener ----------------------------------------------------------------------

    def worker_ready(self, worker: WorkerHandle) -> None:
        """A worker may take batches."""
        self.scheduler.add_runner(worker)
        if self.sequences is not None:
            self.sequences.add_runner(worker)

    def worker_gone(self, worker: WorkerHandle) -> None:
        """A worker died or is being drained."""
        self.scheduler.remove_runner(worker)
        if self.sequences is not None:
            self.sequences.remove_runner(worker)

    def max_batch_size_limited(self, size: int, why: str) -> None:
        """Warm-up or an out-of-memory split lowered the largest batch that fits."""
        self.scheduler.limits.limit_max_batch_size(size, why)

    def warmed_up(self, facts: WarmupFacts) -> None:
        """A worker's warm-up latencies (the compute budget's basis) and serving dtype."""
        self.scheduler.limits.observe_warmup(facts.latency_by_batch)
        if facts.serving_dtype:
            self.serving_dtype = facts.serving_dtype

    def worker_replaced(self, reason: RestartReason) -> None:
        """Count a replaced worker."""
        if self._services.metrics is not None:
            self._services.metrics.worker_restarts.labels(self.name, reason).inc()

    def pool_state(self, state: PoolState, reason: str | None) -> None:
        """The pool is serving again, has no live worker, or gave up."""
        if self.state not in ("ready", "restarting"):
            return  # loading, stopping or stopped: the load and stop paths own the state
        if state == "ready":
            self._set_state("ready")
        elif state == "restarting":
            self._set_state("restarting", reason)
            if self.pool.closing:  # stopping: nothing will come back to run what is queued
                refusal = self.refusal() or ShuttingDown("the server is shutting down")
                self.scheduler.fail_all(type(refusal)(f"{self.label} lost its last worker while it was stopping "
                                                      f"({reason}): {refusal.message}",
                                                      retry_after_s=refusal.retry_after_s))
        else:
            self._set_state("failed", reason)
            self.fail_queued(WorkerLost(f"{self.label} failed: {reason}"))
