"""The worker processes of one model: spawn, restart with backoff, recycle on memory, report.

A worker that dies is noticed at once (its pipe closes) and restarted with exponential backoff,
up to a limit after which the pool reports itself failed with the reason. A worker that grows
past `memory_limit_bytes` is drained (its running batch finishes) and replaced; memory is
checked after every batch and once a second. The pool tells its owner what happened through
`PoolListener` (typed calls, no shared fields): which workers may take batches, the largest
batch warm-up proved fits, and the pool's state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, Protocol

from servewell.config.model import ModelConfig
from servewell.errors import InvalidInput
from servewell.observability.process import rss_bytes as process_rss_bytes
from servewell.observability.tracing import TracingSettings
from servewell.workers.handle import WorkerHandle, WorkerLoadError
from servewell.workers.messages import BatchDone

log = logging.getLogger("servewell.workers")

PoolState = Literal["ready", "restarting", "failed"]
RestartReason = Literal["crash", "memory"]

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
#: A worker that served this long since its last restart has recovered: the backoff starts over.
STABLE_AFTER_S = 60.0
MEMORY_CHECK_INTERVAL_S = 1.0

#: (instance, stage, elapsed_s) while a worker loads.
PoolProgressFn = Callable[[int, str, float], None]


class PoolListener(Protocol):
    """What a pool reports to the model that owns it."""

    def worker_ready(self, worker: WorkerHandle) -> None:
        """`worker` loaded and warmed up: it may take batches."""
        ...

    def worker_gone(self, worker: WorkerHandle) -> None:
        """`worker` died or is being drained: hand it no more batches."""
        ...

    def max_batch_size_limited(self, size: int, why: str) -> None:
        """Warm-up or an out-of-memory split proved batches above `size` do not fit."""
        ...

    def worker_replaced(self, reason: RestartReason) -> None:
        """A worker is being replaced (counted in metrics)."""
        ...

    def pool_state(self, state: PoolState, reason: str | None) -> None:
        """The pool as a whole: serving, restarting (no live worker), or failed for good."""
        ...


class WorkerPool:
    """`config.instances` worker processes of one model, kept alive."""

    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        listener: PoolListener,
        load_timeout_s: float,
        tracing: TracingSettings | None = None,
        on_progress: PoolProgressFn | None = None,
    ) -> None:
        self.config = config
        self._model_dir = model_dir
        self._listener = listener
        self._load_timeout_s = load_timeout_s
        self._tracing = tracing
        self._on_progress = on_progress
        self._workers: list[WorkerHandle | None] = [None] * config.instances
        self._retiring: set[WorkerHandle] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._backoff_step = 0
        self._stopping = False
        self.restarts = 0
        self.recycles = 0
        self.last_failure: str | None = None

    @property
    def workers(self) -> list[WorkerHandle | None]:
        """The current worker of each instance slot (None before its first start)."""
        return list(self._workers)

    async def start(self) -> None:
        """Start every instance; raises `WorkerLoadError` (after stopping the others) if any fails."""
        self._stopping = False
        results = await asyncio.gather(*(self._start(i) for i in range(len(self._workers))), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise failures[0] if isinstance(failures[0], WorkerLoadError) else WorkerLoadError(str(failures[0]))
        self._spawn_task(self._watch_memory())

    async def _start(self, index: int) -> None:
        progress = None
        if self._on_progress is not None:
            report = self._on_progress
            progress = lambda stage, elapsed: report(index, stage, elapsed)  # noqa: E731
        worker = WorkerHandle(self.config, self._model_dir, progress, self._tracing, index,
                              on_lost=self._on_lost, on_batch_done=self._after_batch)
        self._workers[index] = worker
        try:
            info = await worker.start(self._load_timeout_s)
        except WorkerLoadError as exc:
            raise WorkerLoadError(f"instance {index}: {exc}") from None
        if info.effective_max_batch_size:
            self._listener.max_batch_size_limited(
                info.effective_max_batch_size, "warm-up measured that larger batches break memory_limit_bytes")
        self._listener.worker_ready(worker)

    async def profile(self, instance: int, seconds: float, directory: str) -> str:
        """Profile one instance's batches for `seconds`; the trace file's path."""
        worker = self._workers[instance] if 0 <= instance < len(self._workers) else None
        if worker is None:
            raise InvalidInput(f"model '{self.config.name}' has instances 0..{len(self._workers) - 1}")
        return await worker.profile(seconds, directory)

    # --- supervision ---------------------------------------------------------------------

    def _on_lost(self, worker: WorkerHandle) -> None:
        self._listener.worker_gone(worker)
        if self._stopping or worker in self._retiring:
            return
        index = worker.instance
        self.restarts += 1
        self._listener.worker_replaced("crash")
        log.warning("model %s instance %d: worker %s died (%s); restarting", self.config.name, index, worker.pid,
                    worker.exit_reason, extra={"model": self.config.name})
        self.last_failure = f"worker {worker.pid} died ({worker.exit_reason})"
        if not any(w is not None and w.alive for w in self._workers):
            self._listener.pool_state("restarting", self.last_failure)
        self._spawn_task(self._restart(index, worker))

    async def _restart(self, index: int, lost: WorkerHandle) -> None:
        if lost.ready_at is not None and time.monotonic() - lost.ready_at > STABLE_AFTER_S:
            self._backoff_step = 0
        while self._backoff_step < len(RESTART_BACKOFF_S) and not self._stopping:
            await asyncio.sleep(RESTART_BACKOFF_S[self._backoff_step])
            self._backoff_step += 1
            if self._stopping:
                return
            try:
                await self._start(index)
            except WorkerLoadError as exc:
                self.last_failure = str(exc)
                continue
            if all(w is not None and w.alive for w in self._workers):
                self._listener.pool_state("ready", None)
            return
        if not self._stopping:
            reason = f"worker restarted {self._backoff_step} times without recovering; last: {self.last_failure}"
            log.error("model %s failed: %s", self.config.name, reason, extra={"model": self.config.name})
            self._listener.pool_state("failed", reason)

    def _after_batch(self, worker: WorkerHandle, done: BatchDone) -> None:
        if done.oom_limited_batch_size:
            self._listener.max_batch_size_limited(done.oom_limited_batch_size, "a batch ran out of device memory")
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
        limit = self.config.memory_limit_bytes
        if limit is None or worker in self._retiring or self._stopping or worker.rss_bytes <= limit:
            return
        reason = f"resident memory {worker.rss_bytes >> 20} MiB exceeds memory_limit_bytes {limit >> 20} MiB"
        log.warning("model %s instance %d: %s; draining and replacing worker %s", self.config.name, worker.instance,
                    reason, worker.pid, extra={"model": self.config.name})
        self._retiring.add(worker)
        self.recycles += 1
        self._listener.worker_replaced("memory")
        self._listener.worker_gone(worker)
        self._spawn_task(self._replace(worker))

    async def _replace(self, worker: WorkerHandle) -> None:
        await worker.stop()  # the batch in hand finishes first: Shutdown queues behind it
        self._retiring.discard(worker)
        if self._stopping:
            return
        try:
            await self._start(worker.instance)
        except WorkerLoadError as exc:
            self.last_failure = str(exc)
            replacement = self._workers[worker.instance]
            if replacement is not None:
                self._on_lost(replacement)

    def _spawn_task(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # keep a reference until it finishes (the loop holds only a weak one)
        task.add_done_callback(self._tasks.discard)

    # --- lifecycle -----------------------------------------------------------------------

    def any_alive(self) -> bool:
        """Whether at least one worker can run batches."""
        return any(w is not None and w.alive for w in self._workers)

    async def stop(self) -> None:
        """Stop every worker (each finishes the batch in hand first) and every supervision task."""
        self._stopping = True
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.gather(*(w.stop() for w in self._workers if w is not None), return_exceptions=True)
