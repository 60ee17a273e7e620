"""Frontend side of one worker process: start it, follow its load, watch it, end it.

What crosses its pipe once it runs (batches, steps, profiles, their outcomes) is the
`WorkerChannel`'s (workers/channel.py); how its process is made (a spare adopted or forked, or a
fresh spawn) and ended with its group is `WorkerProcess`'s (workers/worker_process.py); this
handle is the worker's lifecycle, and the `BatchRunner` its model's scheduler sees. The channel
learns of a worker's death (pipe EOF) the moment it happens and tells the handle.

A worker that stops making progress without dying (SIGSTOP, a deadlock, a wedged device) closes
no pipe; its heartbeat counter (a shared-memory cell a thread of the worker increments) stops
moving, or its batch overruns its budget. `declare_hung` then kills it and treats it as lost at
once, without waiting for the pipe. Every shared-memory segment of the worker carries this
handle's name prefix, and all of them are removed whenever the worker ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.batch_runner import BatchOutcome
from servewell.errors import ServeError, WorkerHung, WorkerLost
from servewell.observability.tracing import TracingSettings
from servewell.observability.worker_events import WorkerEventSink
from servewell.workers.channel import WorkerChannel
from servewell.workers.cold_start import ColdStartBreakdown, breakdown_of
from servewell.workers.lifecycle import WorkerLifecycle, WorkerPhase, WorkerState, describe_exit
from servewell.workers.load_slots import LoadRetryPolicy, LoadSlots
from servewell.workers.messages import (
    BatchDone,
    LoadProgress,
    SequenceJoin,
    Shutdown,
    SpareReady,
    StepDone,
    StepFailed,
    WorkerLaunch,
    WorkerLoadFailed,
    WorkerMessage,
    WorkerReady,
)
from servewell.workers.output_cap import OutputLimits
from servewell.workers.process_start import find_jemalloc
from servewell.workers.shm import HeartbeatCell, SharedArena, new_prefix, remove_segments, shm_directory
from servewell.workers.spare import SpareWorkers
from servewell.workers.worker_process import StoppedBeforeStart, WorkerProcess

log = logging.getLogger("servewell.workers")

ProgressCallback = Callable[[str, float], None]
__all__ = ["WorkerHandle", "WorkerLoadCrashed", "WorkerLoadError", "WorkerLoadStarved", "WorkerLoadTimedOut",
           "WorkerSettings", "WorkerState", "describe_exit", "find_jemalloc"]

#: How often a worker's heartbeat thread increments its counter.
HEARTBEAT_INTERVAL_S = 0.1
#: How long a worker whose pipe closed may take to exit before it is killed (one normally exits
#: within a millisecond of its pipe closing; its requests are answered once it has).
EXIT_GRACE_S = 5.0


@dataclass(slots=True, frozen=True)
class WorkerSettings:
    """Server settings every worker of the server is started and watched with."""

    heartbeat_timeout_s: float = 2.0
    log_level: str = "info"
    log_format: str = "json"
    tracing: TracingSettings | None = None
    #: Pre-spawned workers a start takes before it spawns one (None: always spawn).
    spares: SpareWorkers | None = None
    #: Warm-up runs batch sizes 1 and 2 only where no memory limit needs larger ones proven.
    warmup_first_only: bool = False
    #: "idle": loads run at SCHED_IDLE where they may (`process_main.load_policy`); "normal".
    load_cpu_policy: str = "normal"
    #: The turns every worker start of the engine takes (None: no bound).
    load_slots: LoadSlots | None = None
    #: When a load that timed out or crashed is tried again (`WorkerPool`).
    load_retry: LoadRetryPolicy = LoadRetryPolicy()
    #: How much of a worker's stdout and stderr reaches the log.
    output: OutputLimits = OutputLimits()
    #: The largest answer to one request, in bytes, of a model whose config sets none (0: no bound).
    max_output_bytes: int = 0
    #: Where replacements are reported, with their cause and gap (observability/worker_events.py).
    events: WorkerEventSink | None = None


class WorkerLoadError(Exception):
    """The worker could not load its model (the message says why)."""

    #: Whether the same load may succeed later (it ran out of time, its process died), rather than
    #: failing the same way (the model refused it).
    retryable = False


class WorkerLoadTimedOut(WorkerLoadError):
    """The load did not finish within the load timeout (counted from its turn); the worker was killed."""

    retryable = True


class WorkerLoadCrashed(WorkerLoadError):
    """The worker process died while it loaded (a crash, an out-of-memory kill)."""

    retryable = True


class WorkerLoadStarved(WorkerLoadError):
    """The load at idle priority waited for a core too long; the worker has exited. Not the
    model's fault: load it again at normal priority."""


class WorkerHandle:
    """One model instance in its own process; a `BatchRunner` for the model's scheduler."""

    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        on_progress: ProgressCallback | None = None,
        settings: WorkerSettings | None = None,
        instance: int = 0,
        on_lost: Callable[[WorkerHandle], None] | None = None,
        on_batch_done: Callable[[WorkerHandle, BatchDone], None] | None = None,
        device: str = "",
    ) -> None:
        self.config = config
        #: The device the worker runs on, chosen by the pool ("": the config's `device`).
        self.device = device or config.device
        self._settings = settings or WorkerSettings()
        self.instance = instance
        self.model_dir = model_dir
        self._on_progress = on_progress
        self._process = WorkerProcess()  # its operating-system process, once `start` launched it
        #: Its pipe and segments once `start` made them (batches, steps, profiles).
        self._channel: WorkerChannel | None = None
        #: Where a generative model's steps go (`listen_to_steps`), for each channel a start makes.
        self._step_listener: Callable[[StepDone | StepFailed], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[WorkerReady] | None = None
        #: Every segment of this worker, both directions and the heartbeat, starts with this.
        self.segment_prefix = new_prefix()
        self._arena_prefix = f"{self.segment_prefix}-in"  # the batches' input arena
        self._heartbeat: HeartbeatCell | None = None
        self._beat = 0
        self._beat_at = 0.0
        self._life = WorkerLifecycle()
        self.rss_bytes = 0
        self.rows_computed = 0
        self.ready_at: float | None = None
        self._on_lost = on_lost
        self._on_batch_done = on_batch_done
        #: Where the last `start` went (None until a start succeeds).
        self.cold_start: ColdStartBreakdown | None = None
        #: Which attempt at loading this instance this worker is (1: the first; `WorkerPool` retries).
        self.load_attempt = 1
        #: While it waits to retry a failed load (state "backoff"): when it will start (Unix seconds).
        self.next_attempt_at: float | None = None

    @property
    def alive(self) -> bool:
        """Whether the worker can take batches (loading or ready)."""
        return self._life.alive

    @property
    def state(self) -> WorkerState:
        """starting, queued (for a load slot), backoff (to retry a failed load), ready, hung,
        exiting, exited or stopped."""
        return self._life.phase.state

    @property
    def exit_reason(self) -> str:
        """How the worker ended, in words ("exit code 3", "hung (...); killed"); empty while it runs."""
        return self._life.exit_reason

    @property
    def hung_reason(self) -> str | None:
        """Why it was declared hung, if it was."""
        return self._life.hung_reason

    @property
    def pid(self) -> int | None:
        """Process id of the worker, once started."""
        return self._process.pid

    def backing_off(self, attempt: int, next_attempt_at: float) -> None:
        """This worker is load attempt `attempt` of its instance, waiting to start at
        `next_attempt_at` (Unix seconds) after the previous one failed."""
        self.load_attempt, self.next_attempt_at = attempt, next_attempt_at
        self._life.backing_off()

    def queued(self) -> None:
        """It waits for a load slot."""
        self.next_attempt_at = None
        self._life.queued()

    async def start(self, timeout_s: float, began_at: float | None = None) -> WorkerReady:
        """Start the worker (a spare of `settings.spares` when one is idle or can be forked, else a
        fresh spawn) and
        wait until its model is loaded and warmed up, at most until `began_at + timeout_s`
        (`time.monotonic()`; default: now). `WorkerLoadTimedOut` past it, `WorkerLoadCrashed` when
        the process dies, `WorkerLoadError` when the model cannot load."""
        requested_at = time.monotonic()
        deadline = (requested_at if began_at is None else began_at) + timeout_s
        self.next_attempt_at = None
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        try:
            self._heartbeat = HeartbeatCell(f"{self.segment_prefix}-hb", create=True)
            # The batch arena is made (and its memory reserved) now, not at the first batch: a worker
            # that is ready keeps serving small batches when /dev/shm fills up later (issue 45 H14).
            self._channel = WorkerChannel(SharedArena(prefix=self._arena_prefix), self._dispatch, self._lost,
                                          self._on_done)
            if self._step_listener is not None:
                self._channel.listen_to_steps(self._step_listener)
        except OSError as exc:  # /dev/shm full or not writable: the load fails saying so
            self._release_segments()
            raise WorkerLoadError(f"no shared memory for the worker's segments in {shm_directory()}: {exc}") from None
        settings = self._settings
        launch = WorkerLaunch(
            str(self.model_dir), self.instance, self.segment_prefix, self._heartbeat.name, HEARTBEAT_INTERVAL_S,
            settings.log_level, settings.log_format, settings.tracing, self.device, settings.warmup_first_only,
            settings.load_cpu_policy, settings.max_output_bytes,
        )
        try:
            spare, parent, fresh_reason = await self._process.launch(self.config, launch, settings.spares,
                                                                     settings.output, lambda: self._life.ended)
        except StoppedBeforeStart as stopped:
            self._release_segments()
            raise WorkerLoadError(str(stopped)) from None
        self._process.relabel(self.config.name, self.instance)
        self._life.spawned()
        self._channel.attach(parent, self._loop)
        try:
            info = await asyncio.wait_for(asyncio.shield(self._ready), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.kill()
            raise WorkerLoadTimedOut(f"load did not finish within {timeout_s:g} s; the worker was killed") from None
        finally:
            if spare is not None and settings.spares is not None:
                settings.spares.refill()  # now that the load no longer needs the cores
        if self._life.phase is not WorkerPhase.LOADING:  # it died (or was stopped) just after saying ready
            raise WorkerLoadCrashed(f"worker process {self.pid} {self.exit_reason or 'stopped'} right after loading")
        self.rss_bytes = info.rss_bytes
        self.ready_at = self._beat_at = time.monotonic()
        self._life.loaded()
        self.cold_start = breakdown_of(self.config.name, self.instance, info, requested_at, self.ready_at,
                                       spare is not None, fresh_reason)
        return info

    async def run(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                  deadlines: Sequence[float] = ()) -> BatchOutcome:
        """Run one batch (`send_batch`) and wait for its outcome."""
        return await self.send_batch(parts, traceparent, deadlines)

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                   deadlines: Sequence[float] = ()) -> asyncio.Future[BatchOutcome]:
        """Hand the worker one batch made of the row blocks in `parts`, concatenated along axis 0,
        now; the future resolves with its outcome. The worker skips the blocks (requests) whose
        `deadlines` passed before it computes."""
        channel = self._running_channel()
        try:
            return channel.send_batch(parts, traceparent, deadlines, self._arena_prefix)
        except (OSError, ValueError):
            raise self._gone_error("the worker process is not running") from None

    def send_step(self, joins: tuple[SequenceJoin, ...], leaves: tuple[int, ...]) -> None:
        """Tell a generative model's worker which sequences join and which leave before its next
        step (engine/sequences.py); it steps on its own while any runs, each step to the listener."""
        channel = self._running_channel()
        try:
            channel.send_step(joins, leaves)
        except (OSError, ValueError):
            raise self._gone_error("the worker process is not running") from None

    def listen_to_steps(self, listener: Callable[[StepDone | StepFailed], None]) -> None:
        """Give each step the worker makes (its parts, or the failure that ended its sequences) to `listener`."""
        self._step_listener = listener
        if self._channel is not None:
            self._channel.listen_to_steps(listener)

    def _running_channel(self) -> WorkerChannel:
        if not self.alive or self._channel is None:
            raise self._gone_error("the worker process is not running")
        return self._channel

    def heartbeat_silence_s(self) -> float:
        """Seconds since the worker's heartbeat counter last moved (0 before it is ready)."""
        if self._heartbeat is None or self.state != "ready":
            return 0.0
        now = time.monotonic()
        beat = self._heartbeat.read()
        if beat != self._beat:
            self._beat, self._beat_at = beat, now
        return now - self._beat_at

    def declare_hung(self, reason: str) -> None:
        """The worker stopped making progress: kill it and treat it as lost now (its pipe may
        never close: a process in uninterruptible sleep outlives SIGKILL for a while)."""
        if not self.alive:
            return
        was_ready = self._life.phase is WorkerPhase.READY
        self.kill()
        if self._channel is not None:
            self._channel.close()
        self._life.hung(reason)
        self._process.reap_later(self._loop)
        self._finish_loss(was_ready)

    async def profile(self, seconds: float, directory: str) -> str:
        """Profile this worker's batches for `seconds`; the path of the Chrome trace file."""
        if not self.alive or self._channel is None:
            raise WorkerLost("the worker process is not running")
        return await self._channel.profile(seconds, directory)

    def _dispatch(self, message: WorkerMessage) -> None:
        """A message about the process itself (the channel keeps the batches' and steps')."""
        if isinstance(message, SpareReady):
            return  # an adopted spare said it was ready before it read its model
        if isinstance(message, LoadProgress):
            if self._on_progress:
                self._on_progress(message.stage, message.elapsed_s)
        elif isinstance(message, WorkerReady):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, WorkerLoadFailed):
            if self._life.phase is WorkerPhase.LOADING:
                self._life.load_failed()
            if self._ready is not None and not self._ready.done():
                error = WorkerLoadStarved if message.starved else WorkerLoadError
                self._ready.set_exception(error(message.reason))

    def _on_done(self, done: BatchDone | StepDone) -> None:
        """A batch or a step finished: what the worker says of its memory and rows, then the pool's hook."""
        if isinstance(done, StepDone):
            if done.rss_bytes:
                self.rss_bytes = done.rss_bytes
            return
        self.rss_bytes = done.rss_bytes
        self.rows_computed = done.rows_computed
        if self._on_batch_done is not None:
            self._on_batch_done(self, done)

    def _gone_error(self, why: str) -> ServeError:
        if self.hung_reason is not None:
            return WorkerHung(f"{why}: it was hung ({self.hung_reason}) and was killed; safe to retry")
        return WorkerLost(why)

    def _lost(self) -> None:
        """The worker's pipe closed. Its exit code is read without waiting: when the process has not
        been reaped yet, the loop watches for its exit and the loss is finished then (the log line,
        `exit_reason` and the errors name the exit code)."""
        if self._life.ended:
            return  # already handled (declared hung, then its pipe closed)
        was_ready = self._life.phase is WorkerPhase.READY
        code = self._process.exitcode  # waitpid(WNOHANG): never blocks
        if not self._process.launched or code is not None or self._loop is None:
            self._life.exited(describe_exit(code))
            self._finish_loss(was_ready)
            return
        # The pipe closes as the process exits, a moment before it can be reaped: the loop watches for
        # the exit and never waits for it (it used to, in `process.join`, which blocks for as long as
        # a worker that closed its pipe and its sentinel lives on, however short the timeout).
        self._life.exiting()
        self._process.watch_exit(self._loop, EXIT_GRACE_S, lambda: self._reaped(was_ready))

    def _reaped(self, was_ready: bool) -> None:
        if self._life.phase is not WorkerPhase.EXITING:
            return  # stopped meanwhile: `stop` answered everything
        if self._process.kill_unreaped():
            # It closed its pipe, so it can serve nothing more, yet it did not exit: ended now.
            self._process.reap_later(self._loop)
            self._life.exited(f"closed its pipe but did not exit within {EXIT_GRACE_S:g} s; killed")
        else:
            self._life.exited(describe_exit(self._process.exitcode))
        self._finish_loss(was_ready)

    def _finish_loss(self, was_ready: bool) -> None:
        """Answer everything the lost worker held, free its segments, tell the pool."""
        reason = f"worker process {self.pid} {self.exit_reason}"
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(WorkerLoadCrashed(f"{reason} while loading"))
        if self._channel is not None:
            self._channel.fail_waiting(
                self._gone_error(f"{reason}; the request was not completed and is safe to retry"))
        self._release_segments()
        self._process.end_group()  # what its model forked dies with it
        self._process.close_output()
        # Only a worker that was serving is restarted by its pool: one that dies while loading
        # fails its start instead (the pool's restart loop owns that).
        if was_ready and self._on_lost is not None:
            self._on_lost(self)

    def _release_segments(self) -> None:
        """Unmap and remove every segment of this worker: ours, and those the worker made (by name,
        since a killed worker removes nothing)."""
        if self._channel is not None:
            self._channel.release()
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None
        remove_segments(self.segment_prefix)

    def kill(self) -> None:
        """End the worker and everything its model forked at once (hung load or batch, shutdown
        timeout)."""
        self._process.kill()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit after its current batch; kill it if it does not within `timeout_s`
        (0: kill it now)."""
        self._on_lost = None
        if self._channel is not None and self.alive and timeout_s > 0:
            try:
                self._channel.send(Shutdown())
            except (OSError, ValueError):
                pass
        await self._process.join(timeout_s)
        if self._life.phase is WorkerPhase.EXITING:  # its pipe had closed: now it is reaped
            self._life.exited(describe_exit(self._process.exitcode))
        elif not self._life.ended:
            self._life.stopped()
        if self._channel is not None:
            self._channel.close()
            self._channel.fail_waiting(WorkerLost("the worker was stopped before the batch finished"))
        self._release_segments()
        self._process.close_output()
