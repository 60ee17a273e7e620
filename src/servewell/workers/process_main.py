"""Entry point of a worker process: load one model instance, warm it up, run batches.

Workers are dumb: they load, run what they are given, and report. Everything that
imports a framework (torch, onnxruntime) happens here, never in the frontend.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import numpy as np
from threadpoolctl import threadpool_limits

from servewell.config.model import ModelConfig
from servewell.errors import SharedMemoryFull
from servewell.observability.logging import configure_logging
from servewell.observability.memory_series import worker_name
from servewell.observability.process import rss_bytes
from servewell.observability.process_title import set_process_title
from servewell.observability.steps import set_step_sink
from servewell.observability.tracing import Tracing, context_from_traceparent
from servewell.runtimes.base import DeviceUnusableError, ModelRuntime, OomSplitting, describe_failure
from servewell.threads import idle_every_thread, lower_every_thread
from servewell.workers.backends import import_backend
from servewell.workers.expiry import RowPlan, keep_rows, plan_rows
from servewell.workers.messages import (
    BatchDone,
    BatchFailed,
    LoadProgress,
    ProfileDone,
    RunBatch,
    SequenceChanges,
    Shutdown,
    StartProfile,
    StepDone,
    StepFailed,
    StopProfile,
    WorkerLaunch,
    WorkerLoadFailed,
    WorkerReady,
    WorkerReply,
    receive_message,
    send_message,
)
from servewell.workers.output_limit import answer_refusal
from servewell.workers.profiling import WorkerProfiler
from servewell.workers.shm import HeartbeatCell, SegmentReader, SharedArena

log = logging.getLogger("servewell.workers")

#: A batch reports the worker's resident memory read at most this long ago: reading
#: /proc/self/statm costs 10-25 us, a third of a small batch's whole overhead in the worker, and
#: the figure only feeds /healthz, the console and the memory-headroom alert.
RSS_EVERY_S = 0.05
#: How often a load at idle priority is checked for starvation (`run_at_idle`).
STARVED_WINDOW_S = 0.5

T = TypeVar("T")


class RssReading:
    """The process's resident memory, read again once the last reading is `RSS_EVERY_S` old."""

    __slots__ = ("_at", "_bytes", "_clock", "_source")

    def __init__(self, source: Callable[[], int] = rss_bytes, clock: Callable[[], float] = time.monotonic) -> None:
        self._source, self._clock = source, clock
        self._at = float("-inf")
        self._bytes = 0

    def read(self) -> int:
        """The last reading, or a new one if it is old."""
        now = self._clock()
        if now - self._at >= RSS_EVERY_S:
            self._at, self._bytes = now, self._source()
        return self._bytes


def worker_main(conn: Connection, config: ModelConfig, launch: WorkerLaunch, began_at: float = 0.0) -> None:
    """Run until the frontend says `Shutdown` or goes away (SIGINT and SIGTERM are ignored: see
    `entry.run_worker`). `began_at`: when this process began on this model (`time.monotonic()`: its
    entry point, or the adoption of a spare), the start of the load's import step."""
    # One log format for the whole server: a worker's lines (an OTLP export failure, a model's own
    # warnings) are JSON lines like the frontend's, not Python's plain-text fallback.
    configure_logging(launch.log_level, launch.log_format)
    # ps and top say which model's worker this is (it was an anonymous `python -c ...spawn_main`).
    set_process_title("servewell " + worker_name(config.name, config.version, launch.instance))
    _start_heartbeat(launch)
    # Thread pools read these when the framework is first imported, so set them first.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(config.threads)
    # numpy, and the OpenBLAS it carries, is imported already (by this module, before a spare is
    # adopted): its pool was sized to every CPU, and OpenBLAS's threads spin while they wait. A step
    # of 32 rows of the generative example crossed its threading threshold and the worker of a
    # `threads: 1` model took 0.96 of this 2-core machine's cores, against 0.24. Resize what is loaded.
    threadpool_limits(limits=config.threads)

    instance = launch.instance
    started = time.perf_counter()
    stages: list[tuple[str, float]] = []
    if config.nice:
        lower_every_thread(config.nice)
    if config.cpu_policy == "idle" and hasattr(os, "SCHED_IDLE"):
        try:  # a woken serving process preempts this one at once, whatever the niceness says
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            logging.getLogger("servewell.workers").warning("cpu_policy idle cannot be applied: %s", exc)
    if config.cpu_affinity:
        try:
            os.sched_setaffinity(0, config.affinity_of(instance) or [])
        except (OSError, ValueError) as exc:
            send_message(conn, WorkerLoadFailed(f"cpu_affinity {config.cpu_affinity} cannot be applied: {exc}"))
            conn.close()
            return

    def progress(stage: str) -> None:
        elapsed = time.perf_counter() - started
        stages.append((stage, elapsed))
        send_message(conn, LoadProgress(stage, elapsed))

    try:
        if launch.device and launch.device != config.device:  # the engine chose it (workers/devices.py)
            config = config.model_copy(update={"device": launch.device})
        progress("import runtime")
        import_backend(config.runtime_descriptor)  # a spare already has (workers/backends.py): then instant
        imported_at = time.monotonic()
        from servewell.runtimes import load_runtime
        from servewell.runtimes.base import DtypeReporting
        from servewell.runtimes.warmup import WarmupReport, warm_up

        def load_and_warm_up() -> tuple[ModelRuntime, float, float, WarmupReport | None]:
            runtime = load_runtime(config, Path(launch.model_dir), progress)
            load_s = time.perf_counter() - started
            weights_s = time.monotonic() - imported_at
            report = None
            if config.warmup:
                progress("warm-up")
                report = warm_up(runtime, config, progress, first_only=launch.warmup_first_only)
            return runtime, load_s, weights_s, report

        loaded_at = load_policy(config, launch)
        if loaded_at == "idle":
            (runtime, load_s, weights_s, report), loaded_at = run_at_idle(load_and_warm_up)
        else:
            runtime, load_s, weights_s, report = load_and_warm_up()
    except LoadStarved as exc:
        # The load thread cannot be stopped (it is inside the runtime) nor raised to normal
        # priority again (unprivileged): the process ends, and the engine loads again at normal.
        # No lock is taken on the way out (the starved thread may hold one: logging's, say); the
        # message is one write of a few hundred bytes, atomic on a pipe.
        send_message(conn, WorkerLoadFailed(str(exc), starved=True))
        os._exit(0)
    except Exception as exc:  # any load failure is reported, never raised into the void
        send_message(conn, WorkerLoadFailed(describe_failure(exc)))
        conn.close()
        return

    try:  # made before the worker says it is ready: a ready worker has its arena (issue 45 H14)
        arena = SharedArena(prefix=f"{launch.segment_prefix}-out" if launch.segment_prefix else None)
    except OSError as exc:
        send_message(conn, WorkerLoadFailed(f"no shared memory for the model's outputs: {exc}"))
        conn.close()
        return
    dtype = report.serving_dtype if report else (runtime.serving_dtype if isinstance(runtime, DtypeReporting) else "")
    send_message(conn, WorkerReady(
        os.getpid(), load_s, report.seconds if report else 0.0, rss_bytes(), tuple(stages),
        effective_max_batch_size=report.effective_max_batch_size if report else 0,
        peak_bytes_by_batch=report.peak_bytes_by_batch if report else (),
        serving_dtype=dtype,
        latency_by_batch=report.latency_by_batch if report else (),
        began_at=began_at, import_s=imported_at - began_at if began_at else 0.0, weights_s=weights_s,
        loaded_at=loaded_at,
    ))
    tracing = Tracing(launch.tracing, make_global=True) if launch.tracing is not None else None
    _serve(conn, runtime, config.name, tracing, arena, config.max_output_bytes or launch.max_output_bytes)


def load_policy(config: ModelConfig, launch: WorkerLaunch) -> str:
    """"idle" where the load may run on a SCHED_IDLE thread of its own: the server asks for it and
    no thread the load starts would serve later at that priority (an unprivileged process cannot
    raise a thread's priority again, and threads inherit their starter's). ONNX Runtime on CPU
    with one intra-op thread starts none, in session creation or in a run (counted in
    /proc/self/task); torch's pools and onnxruntime's with more threads would. "normal" elsewhere,
    and where the whole worker is idle already (`cpu_policy: idle`)."""
    if (launch.load_cpu_policy == "idle" and config.runtime == "onnx" and config.threads == 1
            and config.device == "cpu" and config.cpu_policy != "idle" and hasattr(os, "SCHED_IDLE")):
        return "idle"
    return "normal"


class LoadStarved(Exception):
    """The load at idle priority waited for a core most of the time: the machine is busy."""


def run_at_idle(work: Callable[[], T], window_s: float = STARVED_WINDOW_S) -> tuple[T, str]:
    """`work()` on a thread of its own under SCHED_IDLE, and the policy it ran at ("normal" where
    the platform refused). Every `window_s` the thread's run-queue wait is read
    (/proc/self/task/TID/schedstat): `LoadStarved` when it waited for a core more than half of a
    window (a busy machine gives an idle thread almost nothing; loading at normal priority then
    beats waiting for the load timeout)."""
    outcome: list[T] = []
    failure: list[BaseException] = []
    policy = ["idle"]

    def body() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            policy[0] = "normal"  # a sandbox forbids it: the load runs as it would have
        try:
            outcome.append(work())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=body, name="servewell-load", daemon=True)
    thread.start()
    waited = run_queue_wait_s(thread.native_id)
    while True:
        thread.join(window_s)
        if not thread.is_alive():
            break
        now = run_queue_wait_s(thread.native_id)
        if waited is not None and now is not None and now - waited > window_s / 2:
            raise LoadStarved(f"the load waited for a core {now - waited:.2f} s of the last {window_s:g} s "
                              "at idle priority")
        waited = now
    if failure:
        raise failure[0]
    return outcome[0], policy[0]


def run_queue_wait_s(tid: int | None) -> float | None:
    """Seconds thread `tid` of this process has waited runnable for a core (None: not readable)."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _start_heartbeat(launch: WorkerLaunch) -> None:
    """Increment the frontend's heartbeat counter from a thread of its own, independent of batches:
    a busy worker keeps beating, a stopped one (SIGSTOP, a deadlock holding the GIL) does not."""
    if not launch.heartbeat:
        return
    cell = HeartbeatCell(launch.heartbeat, create=False)

    def beat() -> None:
        count = 0
        while True:
            count += 1
            cell.write(count)
            time.sleep(launch.heartbeat_interval_s)

    threading.Thread(target=beat, name="servewell-heartbeat", daemon=True).start()


def _serve(conn: Connection, runtime: ModelRuntime, model: str, tracing: Tracing | None, arena: SharedArena,
           max_output_bytes: int) -> None:
    # Outputs go into `arena`, named after the frontend's prefix for this worker, so the frontend
    # can remove it by name however this process ends.
    reader = SegmentReader()
    rows_computed = 0
    rss = RssReading()
    steps: list[tuple[str, float]] = []
    set_step_sink(lambda name, seconds: steps.append((name, seconds)), tracing.tracer if tracing else None)
    send_lock = threading.Lock()

    def send(reply: WorkerReply) -> None:
        with send_lock:  # the profiler replies from threads of its own (workers/profiling.py)
            send_message(conn, reply)

    profiler = WorkerProfiler(send)
    # Asked once: isinstance against a runtime-checkable Protocol costs 8 us, a tenth of a small
    # batch's whole overhead in the worker.
    splitting = runtime if isinstance(runtime, OomSplitting) else None
    stepper: SequenceStepper | None = None  # a generative model's sequences, once the first joins
    try:
        while True:
            # A generative model steps on its own while a sequence runs, whenever no message waits:
            # a part never waits for the engine's answer to the previous one (issue 48's time
            # between outputs), and a change (a join, a leave) applies before the next step.
            if stepper is not None and stepper.running and (stepper.due or not conn.poll(0)):
                stepped = stepper.advance()
                send(stepped)
                if isinstance(stepped, StepFailed) and stepped.fatal:
                    return  # the device is unusable in this process
                continue
            try:
                message = receive_message(conn)
            except (EOFError, OSError):
                return  # the frontend is gone: nobody to serve
            if isinstance(message, Shutdown):
                # Freeing the model and the process's memory (an evicted worker's exit) takes CPU
                # the resident models' workers should have first: under bench.model_pool's churn,
                # exits at normal priority stretched their p99 (issue 21).
                idle_every_thread()
                return
            if isinstance(message, (StartProfile, StopProfile)):
                _profile(message, profiler, runtime, send)
                continue
            if isinstance(message, SequenceChanges):  # joins and leaves (runtimes/python_sequences.py)
                stepper = stepper or SequenceStepper(runtime, rss)
                applied = stepper.apply(message)
                if applied is not None:
                    send(applied)
                continue
            if not isinstance(message, RunBatch):
                continue
            rows = message.inputs[0].shape[0] if message.inputs and message.inputs[0].shape else 1
            # Right before compute: requests whose deadline passed on the way are not run.
            plan = plan_rows(message.request_rows or (rows,), message.deadlines, time.monotonic())
            rows_computed += plan.rows
            steps.clear()
            if not plan.runs:
                reply: BatchDone | BatchFailed = BatchDone(
                    message.batch_id, arena.name, (), 0.0, rss.read(), rows_computed, skipped=plan.skipped)
            elif tracing is not None and tracing.enabled and message.traceparent:
                with tracing.tracer.start_as_current_span(
                    "compute", context=context_from_traceparent(message.traceparent),
                    attributes={"servewell.model": model, "servewell.batch_size": plan.rows},
                ):
                    reply = _run(message, plan, runtime, reader, arena, rows_computed, steps, rss, splitting,
                                 model, max_output_bytes)
            else:
                reply = _run(message, plan, runtime, reader, arena, rows_computed, steps, rss, splitting, model,
                             max_output_bytes)
            send(reply)
            if isinstance(reply, BatchFailed) and reply.fatal:
                return  # the device is unusable in this process: exit, supervision starts a fresh one
    finally:
        reader.close()
        arena.close()
        runtime.close()
        if tracing is not None:
            tracing.shutdown()


def _profile(message: StartProfile | StopProfile, profiler: WorkerProfiler, runtime: ModelRuntime,
             send: Callable[[WorkerReply], None]) -> None:
    """Start or stop profiling; the profiler replies (perhaps later, from a thread of its own, so
    the batches go on meanwhile), or this does when it fails: the frontend never waits forever."""
    try:
        if isinstance(message, StartProfile):
            profiler.start(runtime, message.directory)
        else:
            profiler.stop()
    except Exception as exc:  # a profiler that fails must not take the worker down
        send(ProfileDone(None, describe_failure(exc)))


def _run(message: RunBatch, plan: RowPlan, runtime: ModelRuntime, reader: SegmentReader, arena: SharedArena,
         rows_computed: int, steps: list[tuple[str, float]], rss: RssReading,
         splitting: OomSplitting | None = None, model: str = "", max_output_bytes: int = 0) -> BatchDone | BatchFailed:
    inputs = reader.arrays(message.segment, message.inputs, copy=False)
    if plan.skipped:
        inputs = keep_rows(inputs, message.request_rows, plan)
    started = time.perf_counter()
    try:
        outputs = runtime.run(inputs)
        compute_s = time.perf_counter() - started
        # An answer over the bound is refused before a byte of it is copied (workers/output_limit.py).
        kept_rows = [message.request_rows[i] for i in plan.kept] if message.request_rows else [plan.rows]
        refusal = answer_refusal(model, outputs, kept_rows, max_output_bytes)
        if refusal is not None:
            return BatchFailed(message.batch_id, refusal.message, refusal=refusal)
        refs = arena.write({k: np.ascontiguousarray(v) for k, v in outputs.items()})
    except SharedMemoryFull as exc:  # the outputs do not fit /dev/shm: 503, the worker serves on
        return BatchFailed(message.batch_id, exc.message, refusal=exc)
    except Exception as exc:
        return BatchFailed(message.batch_id, describe_failure(exc), fatal=isinstance(exc, DeviceUnusableError))
    finally:
        del inputs
    oom_limited = splitting.oom_limited_batch_size if splitting is not None else None
    return BatchDone(message.batch_id, arena.name, refs, compute_s, rss.read(), rows_computed, tuple(steps),
                     oom_limited, plan.skipped)


class SequenceStepper:
    """A generative model's sequences in this worker (runtimes/python_sequences.py): the engine's
    changes applied as they come, one step whenever a sequence runs and nothing waits on the pipe."""

    def __init__(self, runtime: ModelRuntime, rss: RssReading) -> None:
        factory = getattr(runtime, "sequence_set", None)
        self._sequences = factory() if callable(factory) else None
        self._rss = rss
        self._steps = itertools.count(1)
        #: A step is owed: changes were applied since the last one (however many more wait, every
        #: change is followed by a step, so a stream of changes never starves the running sequences).
        self.due = False

    @property
    def running(self) -> bool:
        """Whether a sequence runs (the worker then steps)."""
        return self._sequences is not None and self._sequences.running > 0

    def apply(self, changes: SequenceChanges) -> StepDone | StepFailed | None:
        """Leaves end, joins start; what to tell the engine now (joins that failed to start), if anything."""
        if self._sequences is None:
            return StepFailed(next(self._steps), "this model's runtime runs no sequences (a generate: section "
                                                 "needs a python model, step-wise or a generator)")
        self.due = True
        try:
            failed = self._sequences.apply(changes.joins, changes.leaves)
        except Exception as exc:
            return StepFailed(next(self._steps), describe_failure(exc), fatal=isinstance(exc, DeviceUnusableError))
        return StepDone(next(self._steps), tuple(failed), 0.0, self._rss.read()) if failed else None

    def advance(self) -> StepDone | StepFailed:
        """One step of every running sequence."""
        assert self._sequences is not None
        self.due = False
        started = time.perf_counter()
        try:
            parts = self._sequences.advance()
        except Exception as exc:
            return StepFailed(next(self._steps), describe_failure(exc), fatal=isinstance(exc, DeviceUnusableError))
        return StepDone(next(self._steps), tuple(parts), time.perf_counter() - started, self._rss.read())
