"""The worker processes of one model: spawn, restart with backoff, recycle on memory, watch, report.

A worker that dies is noticed at once (its pipe closes) and restarted with exponential backoff,
up to a limit after which the pool reports itself failed with the reason. A worker whose
heartbeat stops (SIGSTOP, a deadlock holding the GIL) or whose batch overruns its budget (the
scheduler says so through `WorkerHandle.declare_hung`) is killed and restarted the same way. A
worker that grows past `host_memory_limit_bytes` (resident memory) is drained (its running batch finishes) and
replaced; memory is checked after every batch and once a second. Once the pool is closing (the
server shuts down) nothing is restarted or replaced.

The pool tells its owner what happened through `PoolListener` (typed calls, no shared fields):
which workers may take batches, what warm-up measured, and the pool's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from servewell.config.model import ModelConfig
from servewell.errors import InvalidInput
from servewell.observability.process import rss_bytes as process_rss_bytes
from servewell.workers.cold_start import ColdStartBreakdown, log_breakdown
from servewell.workers.devices import choose_device, visible_gpu_count
from servewell.workers.handle import WorkerHandle, WorkerLoadError, WorkerLoadStarved, WorkerSettings
from servewell.workers.messages import BatchDone, WorkerReady

log = logging.getLogger("servewell.workers")

PoolState = Literal["ready", "restarting", "failed"]
RestartReason = Literal["crash", "hung", "memory"]
RESTART_REASONS: tuple[RestartReason, ...] = ("crash", "hung", "memory")

#: Waits before each restart attempt. The first is immediate: a worker that served well and died
#: once (OOM kill, a hang) should serve again as soon as possible; a crash loop still waits 15 s in all.
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)
#: A worker that served this long since its last restart has recovered: the backoff starts over.
STABLE_AFTER_S = 60.0
MEMORY_CHECK_INTERVAL_S = 1.0
#: How often heartbeats are looked at (a few reads of shared memory; no message, no syscall).
HEARTBEAT_CHECK_INTERVAL_S = 0.25

#: (instance, stage, elapsed_s) while a worker loads.
PoolProgressFn = Callable[[int, str, float], None]


@dataclass(slots=True, frozen=True)
class WarmupFacts:
    """What one worker's warm-up measured."""

    serving_dtype: str
    latency_by_batch: tuple[tuple[int, float], ...]


class PoolListener(Protocol):
    """What a pool reports to the model that owns it."""

    def worker_ready(self, worker: WorkerHandle) -> None:
        """`worker` loaded and warmed up: it may take batches."""
        ...

    def worker_gone(self, worker: WorkerHandle) -> None:
        """`worker` died, hung or is being drained: hand it no more batches."""
        ...

    def max_batch_size_limited(self, size: int, why: str) -> None:
        """Warm-up or an out-of-memory split proved batches above `size` do not fit."""
        ...

    def warmed_up(self, facts: WarmupFacts) -> None:
        """A worker's warm-up measured its batch latencies and settled its serving dtype."""
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
        settings: WorkerSettings | None = None,
        on_progress: PoolProgressFn | None = None,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self._listener = listener
        self._load_timeout_s = load_timeout_s
        self._settings = settings or WorkerSettings()
        self._on_progress = on_progress
        self._workers: list[WorkerHandle | None] = [None] * config.instances
        gpus = visible_gpu_count() if config.device == "cuda" else 0
        #: Each instance's device, decided here (never inside the worker): a restart keeps it.
        self.devices = tuple(choose_device(config.device, i, gpus) for i in range(config.instances))
        self._retiring: set[WorkerHandle] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # restarts and replacements
        self._watchers: set[asyncio.Task[None]] = set()  # heartbeat and memory checks, until `stop`
        self._backoff_step = 0
        self._closing = False
        self._closed = asyncio.Event()  # set with `_closing`: queued and backing-off starts give up
        self._stopped = False
        self.restarts = 0
        self.recycles = 0
        self.last_failure: str | None = None
        #: Where the latest worker start of this pool went (None before one succeeded).
        self.last_start_breakdown: ColdStartBreakdown | None = None

    @property
    def workers(self) -> list[WorkerHandle | None]:
        """The current worker of each instance slot (None before its first start)."""
        return list(self._workers)

    @property
    def closing(self) -> bool:
        """Whether the pool has stopped restarting workers (the server or the model is stopping)."""
        return self._closing

    async def start(self, model_dir: Path | None = None) -> None:
        """Start every instance from `model_dir` (default: the one given at construction), each load
        in its turn (`WorkerSettings.load_slots`) and tried again after a timeout or a crash
        (`WorkerSettings.load_retry`); raises `WorkerLoadError` (after stopping the others) if any
        instance fails for good."""
        if model_dir is not None:
            self.model_dir = model_dir
        results = await asyncio.gather(*(self._start_attempts(i) for i in range(len(self._workers))),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise failures[0] if isinstance(failures[0], WorkerLoadError) else WorkerLoadError(str(failures[0]))
        self._spawn_task(self._watch_memory(), self._watchers)
        self._spawn_task(self._watch_heartbeats(), self._watchers)

    async def _start_attempts(self, index: int) -> None:
        """Start instance `index`; a load that timed out or whose process died is tried again after
        a backoff, while attempts are left (the instance shows state "backoff" and when it starts)."""
        policy = self._settings.load_retry
        attempt, waiting = 1, None
        while True:
            try:
                await self._start(index, attempt, waiting)
                return
            except WorkerLoadError as exc:
                delay_s = policy.delay_before(attempt + 1) if exc.retryable and not self._closing else None
                if delay_s is None:
                    if attempt > 1:
                        raise type(exc)(f"{exc} (load attempt {attempt} of {policy.attempts})") from None
                    raise
                self.last_failure = str(exc)
            attempt += 1
            log.warning("model %s %s; load attempt %d of %d in %.1f s", self.config.name, self.last_failure,
                        attempt, policy.attempts, delay_s,
                        extra={"event": "load_retry_scheduled", "model": self.config.name, "instance": index,
                               "attempt": attempt, "attempts": policy.attempts, "delay_s": delay_s})
            waiting = self._new_worker(index, self._settings)
            waiting.backing_off(attempt, time.time() + delay_s)
            self._workers[index] = waiting
            if not await self._sleep_unless_closing(delay_s):
                await waiting.stop(0)
                raise WorkerLoadError(f"instance {index}: the model is stopping")

    def _new_worker(self, index: int, settings: WorkerSettings) -> WorkerHandle:
        progress = None
        if self._on_progress is not None:
            report = self._on_progress
            progress = lambda stage, elapsed: report(index, stage, elapsed)  # noqa: E731
        return WorkerHandle(self.config, self.model_dir, progress, settings, index, on_lost=self._on_lost,
                            on_batch_done=self._after_batch, device=self.devices[index])

    async def _start(self, index: int, attempt: int = 1, worker: WorkerHandle | None = None) -> None:
        """One load of instance `index` (`worker`: the handle waiting for it, if any), in its turn."""
        settings = self._settings
        worker = worker or self._new_worker(index, settings)
        self._workers[index] = worker
        slots = settings.load_slots
        if slots is None:
            began = time.monotonic()
        else:
            worker.queued()
            turn = await self._unless_closing(slots.acquire())
            if turn is None or self._closing:
                if turn is not None:
                    slots.release()
                await worker.stop(0)
                raise WorkerLoadError(f"instance {index}: the model is stopping")
            began = turn
        try:
            while True:
                try:
                    # The load timeout counts from this load's turn, not from when it was asked for.
                    info = await worker.start(self._load_timeout_s, began)
                except WorkerLoadStarved as exc:
                    if settings.load_cpu_policy == "normal":  # cannot happen: only an idle load starves
                        raise WorkerLoadError(f"instance {index}: {exc}") from None
                    # That worker has exited; its memory is free. The same load at normal priority takes
                    # its share of a busy machine instead of what the served models leave (none).
                    log.warning("model %s instance %d: %s; loading it again at normal priority", self.config.name,
                                index, exc,
                                extra={"event": "load_starved", "model": self.config.name, "instance": index})
                    settings = replace(settings, load_cpu_policy="normal")
                    worker = self._new_worker(index, settings)
                    worker.load_attempt = attempt
                    self._workers[index] = worker
                    # Still in its turn, with the time it has left (at least a second).
                    began = max(began, time.monotonic() + 1.0 - self._load_timeout_s)
                    continue
                except WorkerLoadError as exc:
                    raise type(exc)(f"instance {index}: {exc}") from None
                break
        finally:
            if slots is not None:
                slots.release()
        if self._closing:  # the server began stopping while this worker loaded
            await worker.stop()
            raise WorkerLoadError(f"instance {index}: the model is stopping")
        if worker.cold_start is not None:
            self.last_start_breakdown = worker.cold_start
            log_breakdown(worker.cold_start)
        self._report_warmup(info)
        events = self._settings.events
        if events is not None:  # closes the gap of a replacement (a first start had none open)
            events.back(self.config.name, self.config.version, index, worker.pid)
        self._listener.worker_ready(worker)

    async def _unless_closing(self, awaitable: Awaitable[float]) -> float | None:
        """What `awaitable` returns, or None (it is cancelled) once the pool is closing first."""
        task = asyncio.ensure_future(awaitable)
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((task, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return None if task.cancelled() else task.result()

    async def _sleep_unless_closing(self, delay_s: float) -> bool:
        """Sleep `delay_s`; False as soon as the pool is closing."""
        try:
            await asyncio.wait_for(self._closed.wait(), delay_s)
        except TimeoutError:
            return True
        return False

    def _report_warmup(self, info: WorkerReady) -> None:
        if info.effective_max_batch_size:
            self._listener.max_batch_size_limited(
                info.effective_max_batch_size, "warm-up measured that larger batches break the model's memory limit")
        self._listener.warmed_up(WarmupFacts(info.serving_dtype, info.latency_by_batch))

    async def profile(self, instance: int, seconds: float, directory: str) -> str:
        """Profile one instance's batches for `seconds`; the trace file's path."""
        worker = self._workers[instance] if 0 <= instance < len(self._workers) else None
        if worker is None:
            raise InvalidInput(f"model '{self.config.name}' has instances 0..{len(self._workers) - 1}")
        return await worker.profile(seconds, directory)

    # --- supervision ---------------------------------------------------------------------

    def _on_lost(self, worker: WorkerHandle) -> None:
        self._listener.worker_gone(worker)
        if worker in self._retiring:
            return
        index = worker.instance
        hung = worker.hung_reason is not None
        self.last_failure = f"instance {index}: worker {worker.pid} {worker.exit_reason}"
        if self._closing:
            log.warning("model %s instance %d: worker %s %s during shutdown; not restarted", self.config.name,
                        index, worker.pid, worker.exit_reason, extra={"model": self.config.name})
            if not self.any_alive():
                self._listener.pool_state("restarting", self.last_failure)
            return
        self.restarts += 1
        self._listener.worker_replaced("hung" if hung else "crash")
        self._left(worker, "hung" if hung else "crash", worker.exit_reason)
        log.warning("model %s instance %d: worker %s %s; restarting", self.config.name, index, worker.pid,
                    worker.exit_reason, extra={"model": self.config.name, "instance": index,
                                               "reason": "hung" if hung else "crash"})
        if not self.any_alive():
            self._listener.pool_state("restarting", self.last_failure)
        self._spawn_task(self._restart(index, worker))

    async def _restart(self, index: int, lost: WorkerHandle) -> None:
        if lost.ready_at is not None and time.monotonic() - lost.ready_at > STABLE_AFTER_S:
            self._backoff_step = 0
        while self._backoff_step < len(RESTART_BACKOFF_S) and not self._closing:
            await asyncio.sleep(RESTART_BACKOFF_S[self._backoff_step])
            self._backoff_step += 1
            if self._closing:
                return
            try:
                await self._start(index)
            except WorkerLoadError as exc:
                self.last_failure = str(exc)
                log.warning("model %s instance %d: restart %d failed: %s", self.config.name, index,
                            self._backoff_step, exc, extra={"model": self.config.name})
                continue
            if all(w is not None and w.alive for w in self._workers):
                self._listener.pool_state("ready", None)
            return
        if not self._closing:
            reason = f"worker restarted {self._backoff_step} times without recovering; last: {self.last_failure}"
            log.error("model %s failed: %s", self.config.name, reason, extra={"model": self.config.name})
            self._listener.pool_state("failed", reason)

    async def _watch_heartbeats(self) -> None:
        # A stopped process closes no pipe: only its silence tells. Busy workers keep beating (the
        # heartbeat is a thread of their own), so a long batch is never mistaken for a hang here.
        # This goes on while the server drains: a hung worker then is killed and its requests answered.
        timeout_s = self._settings.heartbeat_timeout_s
        while not self._stopped:
            await asyncio.sleep(HEARTBEAT_CHECK_INTERVAL_S)
            for worker in list(self._workers):
                if worker is None or not worker.alive or worker in self._retiring:
                    continue
                silence = worker.heartbeat_silence_s()
                if silence > timeout_s:
                    self.declare_hung(worker, f"no heartbeat for {silence:.1f} s (stopped, or stuck holding the GIL)")

    def declare_hung(self, worker: WorkerHandle, reason: str) -> None:
        """Kill a worker that stopped making progress; it is restarted like a crashed one."""
        if not worker.alive:
            return
        log.error("model %s instance %d: worker %s is hung: %s; killing it", self.config.name, worker.instance,
                  worker.pid, reason, extra={"model": self.config.name, "instance": worker.instance})
        worker.declare_hung(reason)

    def _after_batch(self, worker: WorkerHandle, done: BatchDone) -> None:
        if done.oom_limited_batch_size:
            self._listener.max_batch_size_limited(done.oom_limited_batch_size, "a batch ran out of device memory")
        self._check_memory(worker)

    async def _watch_memory(self) -> None:
        # Between batches a worker can still grow (a leak in a background thread); check it too.
        while not self._stopped:
            await asyncio.sleep(MEMORY_CHECK_INTERVAL_S)
            for worker in list(self._workers):
                if worker is not None and worker.alive and worker.pid:
                    worker.rss_bytes = process_rss_bytes(worker.pid) or worker.rss_bytes
                    self._check_memory(worker)

    def _check_memory(self, worker: WorkerHandle) -> None:
        limit = self.config.host_memory_limit_bytes
        if limit is None or worker in self._retiring or self._closing or worker.rss_bytes <= limit:
            return
        reason = f"resident memory {worker.rss_bytes >> 20} MiB exceeds host_memory_limit_bytes {limit >> 20} MiB"
        log.warning("model %s instance %d: %s; draining and replacing worker %s", self.config.name, worker.instance,
                    reason, worker.pid, extra={"model": self.config.name})
        self._retiring.add(worker)
        self.recycles += 1
        self._listener.worker_replaced("memory")
        self._left(worker, "memory", reason)
        self._listener.worker_gone(worker)
        self._spawn_task(self._replace(worker))

    async def _replace(self, worker: WorkerHandle) -> None:
        await worker.stop()  # the batch in hand finishes first: Shutdown queues behind it
        self._retiring.discard(worker)
        if self._closing:
            return
        try:
            await self._start(worker.instance)
        except WorkerLoadError as exc:
            self.last_failure = str(exc)
            self.restarts += 1
            self._listener.worker_replaced("crash")
            self._left(worker, "crash", str(exc))
            if not self.any_alive():
                self._listener.pool_state("restarting", self.last_failure)
            self._spawn_task(self._restart(worker.instance, worker))

    def _left(self, worker: WorkerHandle, reason: RestartReason, detail: str) -> None:
        """Tell the server's replacement log (observability/worker_events.py) that `worker` left
        service for `reason`, and how many other instances still serve."""
        events = self._settings.events
        if events is None:
            return
        others = sum(1 for w in self._workers if w is not None and w is not worker and w.alive
                     and w not in self._retiring)
        events.left(self.config.name, self.config.version, worker.instance, reason, detail, worker.pid, others)

    def _spawn_task(self, coroutine: Coroutine[Any, Any, None], into: set[asyncio.Task[None]] | None = None) -> None:
        tasks = self._tasks if into is None else into
        task = asyncio.get_running_loop().create_task(coroutine)
        tasks.add(task)  # keep a reference until it finishes (the loop holds only a weak one)
        task.add_done_callback(tasks.discard)

    # --- lifecycle -----------------------------------------------------------------------

    def any_alive(self) -> bool:
        """Whether at least one worker can run batches."""
        return any(w is not None and w.alive for w in self._workers)

    def close(self) -> None:
        """Restart and replace nothing from now on (the server or this model is stopping); the
        workers keep serving what they were given until `stop`."""
        self._closing = True
        self._closed.set()
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (each finishes the batch in hand first, within `timeout_s`; 0 kills them
        at once) and every supervision task."""
        self.close()
        self._stopped = True
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*(w.stop(timeout_s) for w in self._workers if w is not None), return_exceptions=True)
