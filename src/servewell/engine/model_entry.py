"""One served model: its workers, its scheduler and the truth about its state.

Supervision: a worker that dies is noticed at once (its pipe closes) and restarted with
exponential backoff, up to a limit after which the model is marked failed with the reason.
A worker that grows past `memory_limit_bytes` is drained (its running batch finishes) and
replaced; memory is checked after every batch and once a second.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from servewell.config.model import ModelConfig
from servewell.engine.memory_budget import MemoryBudget, estimate_model_memory
from servewell.engine.scheduler import ModelScheduler
from servewell.errors import InvalidInput, WorkerLost
from servewell.observability.metrics import ServeMetrics
from servewell.observability.tracing import Tracing
from servewell.workers.handle import WorkerHandle, WorkerLoadError, process_rss_bytes

log = logging.getLogger("servewell.engine")

ModelState = Literal["loading", "ready", "restarting", "failed", "invalid", "unloaded"]

#: (model, instance, stage, elapsed_s) while a worker loads.
LoadProgressFn = Callable[[str, int, str, float], None]

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
#: A worker that served this long since its last restart has recovered: the backoff starts over.
STABLE_AFTER_S = 60.0
MEMORY_CHECK_INTERVAL_S = 1.0

_generation = itertools.count(1)


@dataclass(slots=True)
class InstanceInfo:
    """What /healthz shows of one worker."""

    instance: int
    pid: int | None
    alive: bool
    rss_bytes: int
    rows_computed: int


class ModelEntry:
    """Owns the worker processes of one model and restarts them when they die."""

    def __init__(
        self,
        name: str,
        directory: Path,
        config: ModelConfig | None,
        error: str | None,
        load_timeout_s: float,
        budget: MemoryBudget,
        on_progress: LoadProgressFn | None = None,
        metrics: ServeMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.name = name
        self.directory = directory
        self.config = config
        self.state: ModelState = "invalid" if config is None else "unloaded"
        self.reason: str | None = error
        self.load_s: float | None = None
        self.restarts = 0
        self.recycles = 0
        tracer = tracing.tracer if tracing is not None and tracing.enabled else None
        self.scheduler = ModelScheduler(config, metrics, tracer) if config is not None else None
        self._tracing_settings = tracing.settings if tracing is not None and tracing.enabled else None
        self._metrics = metrics
        if metrics is not None:  # series exist from the start, so increase() sees the first event
            for reason in ("crash", "memory"):
                metrics.worker_restarts.labels(name, reason)
            for result in ("success", "failure"):
                metrics.model_loads.labels(name, result)
        self._workers: list[WorkerHandle | None] = []
        self._load_timeout_s = load_timeout_s
        self._budget = budget
        self._budget_key = f"{name}#{next(_generation)}"
        self._on_progress = on_progress
        self._backoff_step = 0
        self._stopping = False
        self._monitor: asyncio.Task | None = None

    @property
    def version(self) -> str:
        """Served version ("1" when the config is invalid)."""
        return self.config.version if self.config else "1"

    def instances(self) -> list[InstanceInfo]:
        """Per-instance process facts."""
        return [
            InstanceInfo(i, w.pid if w else None, bool(w and w.alive), w.rss_bytes if w else 0,
                         w.rows_computed if w else 0)
            for i, w in enumerate(self._workers)
        ]

    async def load(self) -> None:
        """Check the memory budget, then start every instance; ready once all have warmed up."""
        if self.config is None:
            return
        self.state, self.reason = "loading", None
        self._stopping = False
        try:
            self._budget.reserve(self._budget_key, estimate_model_memory(self.config, self.directory))
        except (MemoryError, OSError, ValueError) as exc:
            self._count_load(False)
            self.state, self.reason = "failed", f"refused before loading: {exc}"
            log.error("model %s not loaded: %s", self.name, self.reason, extra={"model": self.name})
            return
        started = time.perf_counter()
        self._workers = [None] * self.config.instances
        results = await asyncio.gather(
            *(self._start_instance(i) for i in range(self.config.instances)), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        self._count_load(not failures)
        if failures:
            self.state, self.reason = "failed", str(failures[0])
            await self._stop_workers()
            self._budget.release(self._budget_key)
            log.error("model %s failed to load: %s", self.name, self.reason, extra={"model": self.name})
            return
        self.load_s = time.perf_counter() - started
        self.state = "ready"
        self._monitor = asyncio.get_running_loop().create_task(self._watch_memory())
        log.info("model %s ready in %.2f s", self.name, self.load_s, extra={"model": self.name})

    def _count_load(self, ok: bool) -> None:
        if self._metrics is not None:
            self._metrics.model_loads.labels(self.name, "success" if ok else "failure").inc()

    def _count_restart(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.worker_restarts.labels(self.name, reason).inc()

    async def _start_instance(self, index: int) -> None:
        assert self.config is not None and self.scheduler is not None
        progress = None
        if self._on_progress is not None:
            progress = lambda stage, elapsed: self._on_progress(self.name, index, stage, elapsed)  # noqa: E731
        worker = WorkerHandle(self.config, self.directory, progress, self._tracing_settings, index)
        self._workers[index] = worker
        try:
            info = await worker.start(self._load_timeout_s)
        except WorkerLoadError as exc:
            raise WorkerLoadError(f"instance {index}: {exc}") from None
        if info.effective_max_batch_size and info.effective_max_batch_size < self.scheduler.max_batch_size:
            log.warning("model %s: warm-up lowered max_batch_size from %d to %d to stay within memory_limit_bytes",
                        self.name, self.scheduler.max_batch_size, info.effective_max_batch_size,
                        extra={"model": self.name})
            self.scheduler.max_batch_size = info.effective_max_batch_size
        worker.on_lost = lambda w, i=index: self._on_worker_lost(i, w)
        worker.on_batch_done = self._after_batch
        self.scheduler.add_worker(worker)

    async def profile(self, instance: int, seconds: float, directory: str) -> str:
        """Profile one instance's batches for `seconds`; the trace file's path."""
        if not 0 <= instance < len(self._workers) or self._workers[instance] is None:
            raise InvalidInput(f"model '{self.name}' has instances 0..{len(self._workers) - 1}")
        return await self._workers[instance].profile(seconds, directory)

    # --- supervision ---------------------------------------------------------------------

    def _on_worker_lost(self, index: int, worker: WorkerHandle) -> None:
        self.scheduler.remove_worker(worker)
        if self._stopping or worker.retiring:
            return
        self.restarts += 1
        self._count_restart("crash")
        log.warning("model %s instance %d: worker %s died (%s); restarting", self.name, index, worker.pid,
                    worker.exit_reason, extra={"model": self.name})
        if not any(w is not None and w.alive for w in self._workers):
            self.state = "restarting"
        asyncio.get_running_loop().create_task(self._restart(index))

    async def _restart(self, index: int) -> None:
        last_ready = self._workers[index].ready_at if self._workers[index] else None
        if last_ready is not None and time.monotonic() - last_ready > STABLE_AFTER_S:
            self._backoff_step = 0
        while self._backoff_step < len(RESTART_BACKOFF_S) and not self._stopping:
            await asyncio.sleep(RESTART_BACKOFF_S[self._backoff_step])
            self._backoff_step += 1
            try:
                await self._start_instance(index)
            except WorkerLoadError as exc:
                self.reason = str(exc)
                continue
            if all(w is not None and w.alive for w in self._workers):
                self.state, self.reason = "ready", None
            return
        if not self._stopping:
            self.state = "failed"
            self.reason = f"worker restarted {self._backoff_step} times without recovering; last: {self.reason}"
            log.error("model %s failed: %s", self.name, self.reason, extra={"model": self.name})
            self.scheduler.fail_all(WorkerLost(f"model '{self.name}' failed: {self.reason}"))

    def _after_batch(self, worker: WorkerHandle) -> None:
        limited = worker.oom_limited_batch_size
        if limited and limited < self.scheduler.max_batch_size:
            log.warning("model %s: out of device memory above %d rows; lowering max_batch_size from %d",
                        self.name, limited, self.scheduler.max_batch_size, extra={"model": self.name})
            self.scheduler.max_batch_size = limited
        self._check_memory(worker)

    async def _watch_memory(self) -> None:
        # Between batches a worker can still grow (a leak in a background thread); check it too.
        while not self._stopping:
            await asyncio.sleep(MEMORY_CHECK_INTERVAL_S)
            for worker in list(self._workers):
                if worker is not None and worker.alive and worker.pid:
                    worker.rss_bytes = process_rss_bytes(worker.pid) or worker.rss_bytes
                    self._check_memory(worker)

    def _check_memory(self, worker: WorkerHandle) -> None:
        limit = self.config.memory_limit_bytes if self.config else None
        if limit is None or worker.retiring or self._stopping or worker.rss_bytes <= limit:
            return
        index = self._workers.index(worker)
        reason = f"resident memory {worker.rss_bytes >> 20} MiB exceeds memory_limit_bytes {limit >> 20} MiB"
        log.warning("model %s instance %d: %s; draining and replacing worker %s", self.name, index, reason,
                    worker.pid, extra={"model": self.name})
        worker.retiring = True
        self.recycles += 1
        self._count_restart("memory")
        self.scheduler.remove_worker(worker)
        asyncio.get_running_loop().create_task(self._replace(index, worker))

    async def _replace(self, index: int, worker: WorkerHandle) -> None:
        await worker.stop()  # the batch in hand finishes first: Shutdown queues behind it
        if self._stopping:
            return
        try:
            await self._start_instance(index)
        except WorkerLoadError as exc:
            self.reason = str(exc)
            self._on_worker_lost(index, self._workers[index] or worker)

    # --- lifecycle -----------------------------------------------------------------------

    async def stop(self) -> None:
        """Drain queued and running requests, then stop every worker."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        if self.scheduler is not None and self.state in ("ready", "restarting"):
            if any(w is not None and w.alive for w in self._workers):
                await self.scheduler.drain()
            else:
                self.scheduler.fail_all(WorkerLost(f"model '{self.name}' has no running worker"))
        await self._stop_workers()
        self._budget.release(self._budget_key)
        if self.config is not None and self.state != "failed":
            self.state = "unloaded"

    async def _stop_workers(self) -> None:
        await asyncio.gather(*(w.stop() for w in self._workers if w is not None))
