"""One served model: its workers, its scheduler and the truth about its state."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from servewell.config.model import ModelConfig
from servewell.engine.scheduler import ModelScheduler
from servewell.errors import WorkerLost
from servewell.workers.handle import WorkerHandle, WorkerLoadError

log = logging.getLogger("servewell.engine")

ModelState = Literal["loading", "ready", "restarting", "failed", "invalid", "unloaded"]

#: (model, instance, stage, elapsed_s) while a worker loads.
LoadProgressFn = Callable[[str, int, str, float], None]

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)


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
        on_progress: LoadProgressFn | None = None,
    ) -> None:
        self.name = name
        self.directory = directory
        self.config = config
        self.state: ModelState = "invalid" if config is None else "unloaded"
        self.reason: str | None = error
        self.load_s: float | None = None
        self.scheduler = ModelScheduler(config) if config is not None else None
        self._workers: list[WorkerHandle | None] = []
        self._load_timeout_s = load_timeout_s
        self._on_progress = on_progress
        self._restarts = 0
        self._stopping = False

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
        """Start every instance; the model is ready once all have loaded and warmed up."""
        if self.config is None:
            return
        self.state, self.reason = "loading", None
        self._stopping = False
        started = time.perf_counter()
        self._workers = [None] * self.config.instances
        results = await asyncio.gather(
            *(self._start_instance(i) for i in range(self.config.instances)), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            self.state, self.reason = "failed", str(failures[0])
            await self._stop_workers()
            log.error("model %s failed to load: %s", self.name, self.reason, extra={"model": self.name})
            return
        self.load_s = time.perf_counter() - started
        self.state = "ready"
        log.info("model %s ready in %.2f s", self.name, self.load_s, extra={"model": self.name})

    async def _start_instance(self, index: int) -> None:
        assert self.config is not None
        progress = None
        if self._on_progress is not None:
            progress = lambda stage, elapsed: self._on_progress(self.name, index, stage, elapsed)  # noqa: E731
        worker = WorkerHandle(self.config, self.directory, progress)
        self._workers[index] = worker
        try:
            await worker.start(self._load_timeout_s)
        except WorkerLoadError as exc:
            raise WorkerLoadError(f"instance {index}: {exc}") from None
        worker.on_lost = lambda w, i=index: self._on_worker_lost(i, w)
        self.scheduler.add_worker(worker)

    def _on_worker_lost(self, index: int, worker: WorkerHandle) -> None:
        self.scheduler.remove_worker(worker)
        if self._stopping:
            return
        log.warning("model %s instance %d: worker %s died; restarting", self.name, index, worker.pid,
                    extra={"model": self.name})
        if not any(w is not None and w.alive for w in self._workers):
            self.state = "restarting"
        asyncio.get_running_loop().create_task(self._restart(index))

    async def _restart(self, index: int) -> None:
        while self._restarts < len(RESTART_BACKOFF_S) and not self._stopping:
            await asyncio.sleep(RESTART_BACKOFF_S[self._restarts])
            self._restarts += 1
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
            self.reason = f"worker restarted {self._restarts} times without recovering; last: {self.reason}"
            self.scheduler.fail_all(WorkerLost(f"model '{self.name}' failed: {self.reason}"))

    async def stop(self) -> None:
        """Drain queued and running requests, then stop every worker."""
        self._stopping = True
        if self.scheduler is not None and self.state in ("ready", "restarting"):
            if any(w is not None and w.alive for w in self._workers):
                await self.scheduler.drain()
            else:
                self.scheduler.fail_all(WorkerLost(f"model '{self.name}' has no running worker"))
        await self._stop_workers()
        if self.config is not None and self.state != "failed":
            self.state = "unloaded"

    async def _stop_workers(self) -> None:
        await asyncio.gather(*(w.stop() for w in self._workers if w is not None))
