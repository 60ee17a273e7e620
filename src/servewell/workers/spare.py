"""Spare worker processes: spawned ahead of time with the runtime imported, adopted by a model load.

A model load used to spawn its worker and wait for the interpreter to start, re-import the server's
main module (multiprocessing's spawn does that), unpickle the config and import numpy and
onnxruntime before reading a single weight. `SpareWorkers` keeps `count` processes that have done
all of that already (`workers/spare_main.py`); `WorkerHandle.start` takes one when it can
(`take`), and the set is refilled in the background: each spawn runs on one thread of its own,
never on the event loop.

Spares are forked from a fork server (multiprocessing's `forkserver`) that imported the runtime
once, so a refill costs a fork, not an interpreter start and the imports: measured 0.01 s of CPU
and 12-21 ms to ready, against 0.8 s of CPU and about 1 s for a spawned spare (2-core machine).
In the lazy repository mode a spare is refilled after every cold start, and that CPU was taken
from the models being served (issue 21's pinned-model p99 under churn). The fork server is a
child of the engine started with the first spare; its children are its own, so the engine learns
of their exit through multiprocessing's pipe and a pidfd as before, and it exits once the engine
and every process it forked have. Its socket lives in the engine's private run directory
(`use_private_temp_dir`), which the supervisor removes on any exit. It imports onnxruntime only
with onnxruntime's telemetry off (`fork_server_preload`), as `servewell` runs it by default.

A model whose worker needs something that only a fresh spawn can give gets a fresh spawn
(`fresh_spawn_reason`): `allocator: jemalloc` must be in LD_PRELOAD before the interpreter starts.
Everything else a worker is given at spawn is applied after adoption by `worker_main` (nice, CPU
affinity, thread counts, device) or carried by `AdoptSpare` (config, launch, process name). The
frameworks' thread counts are set explicitly (onnxruntime's session options, `torch.set_num_threads`);
the OMP/MKL/OpenBLAS variables `worker_main` sets reach only libraries loaded after them, which
was already so for a fresh worker: numpy (OpenBLAS) is imported before them in both.

Spares die with the engine: `stop` ends them; a kill of the engine ends them too (their pipe
closes; PR_SET_PDEATHSIG tied to the fork server covers the moment before they read it).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig
from servewell.config.runtimes import runtime_descriptor
from servewell.config.server import ServerConfig
from servewell.workers.backends import ORT_TELEMETRY_SWITCH, SPARE_RUNTIME, backend_modules
from servewell.workers.child_main import run_child
from servewell.workers.entry import run_spare
from servewell.workers.messages import SpareLaunch, SpareReady, receive_message
from servewell.workers.output_cap import OutputLimits
from servewell.workers.process_start import output_pipe, spawn
from servewell.workers.worker_output import WorkerOutput

log = logging.getLogger("servewell.workers")

#: Spares that die before they are ready this many times in a row stop being replaced (a broken
#: runtime install would otherwise spawn forever); a model load then spawns its worker as before.
MAX_FAILED_SPARES = 3
#: How long `stop` waits for a spare to exit after its pipe closes before killing it.
STOP_GRACE_S = 2.0


#: What the fork server imports once, so that no spare it forks imports it again.
FORK_SERVER_PRELOAD = ("servewell.workers.entry", "servewell.workers.child_main", "servewell.workers.spare_main",
                       "servewell.workers.process_main")


def fork_server_preload() -> list[str]:
    """What the fork server imports: our worker modules, and the spare runtime unless onnxruntime's
    telemetry is on. With it on, the import starts an uploader thread and opens an SQLite event
    database, neither of which a forked child may inherit (the thread is gone in the child, and
    SQLite's file locks are not inherited), so each spare then imports onnxruntime itself."""
    backend = backend_modules(runtime_descriptor(SPARE_RUNTIME)) if os.environ.get(ORT_TELEMETRY_SWITCH) == "1" else ()
    return [*FORK_SERVER_PRELOAD, *backend]


def use_private_temp_dir(directory: Path) -> None:
    """Put multiprocessing's files of this process (the fork server's socket) in `directory`
    (created 0700) instead of a `pymp-*` directory in /tmp, which a killed engine would leave
    behind. multiprocessing has no public setting for it; this is the one its `get_temp_dir`
    reads, and it removes nothing it did not create."""
    directory.mkdir(mode=0o700, exist_ok=True)
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]  # noqa: SLF001
    config["tempdir"] = str(directory)


def _fork_server() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    assert isinstance(context, multiprocessing.context.ForkServerContext)
    context.set_forkserver_preload(fork_server_preload())
    return context


def start_fork_server() -> None:
    """Start this process's fork server now (its imports done once) rather than at the first spare: a
    standby engine does it while it waits (engine_standby.py), so its first worker after taking over
    is a fork."""
    _fork_server()
    multiprocessing.forkserver.ensure_running()


@dataclass(slots=True, eq=False)
class SpareProcess:
    """One spare worker process: the process, the frontend's end of its pipe, and what it said."""

    process: multiprocessing.process.BaseProcess
    conn: Connection
    #: Its stdout and stderr (the model's, once adopted: the adopter takes this over).
    output: WorkerOutput | None = None
    ready: SpareReady | None = None  # set once it has imported the runtime
    watched: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int | None:
        """Its process id."""
        return self.process.pid


def fresh_spawn_reason(config: ModelConfig) -> str | None:
    """Why a worker of `config` cannot be a spare (None: it can)."""
    if config.allocator == "jemalloc":  # also where it is missing: the fresh spawn says so in the log
        return "allocator jemalloc is preloaded (LD_PRELOAD) when the process starts"
    return None


def effective_spare_workers(settings: ServerConfig) -> int:
    """How many spares the engine keeps: `spare_workers`, or by default 1 when models load on
    demand (the lazy repository mode, where loads happen while requests wait) and 0 otherwise."""
    if settings.spare_workers is not None:
        return settings.spare_workers
    return 1 if settings.repository_mode == "lazy" else 0


def effective_warmup_first_only(settings: ServerConfig) -> bool:
    """Whether loads warm up the first batch sizes only: `warmup_batch_sizes`, or by default in
    the lazy repository mode (where a request waits for the load)."""
    if settings.warmup_batch_sizes is not None:
        return settings.warmup_batch_sizes == "first"
    return settings.repository_mode == "lazy"


def effective_load_cpu_policy(settings: ServerConfig) -> str:
    """The policy loads run at: `load_cpu_policy`, or by default idle in the lazy repository mode
    (loads come while the resident models serve: issue 21's p99) and normal in eager mode, where a
    load is a start, reload or restart, and one starved at idle under bench.chaos's saturation
    started over: the engine's recovery after kill -9 took 9.8 s against 5.3 s."""
    if settings.load_cpu_policy is not None:
        return settings.load_cpu_policy
    return "idle" if settings.repository_mode == "lazy" else "normal"


def why_fresh(spares: SpareWorkers | None, config: ModelConfig) -> str:
    """Why a start spawned its worker rather than taking a spare, in words."""
    if spares is None or (spares.count == 0 and not spares.fork_on_demand):
        return "spare_workers is 0"
    return fresh_spawn_reason(config) or ("no spare could be forked" if spares.fork_on_demand else "no spare was idle")


class SpareWorkers:
    """Up to `count` idle worker processes with the runtime imported, for one engine; with
    `fork_on_demand`, one forked for a start that finds none idle (`fork_for`)."""

    def __init__(self, count: int, launch: SpareLaunch | None = None, output: OutputLimits | None = None,
                 fork_on_demand: bool = False) -> None:
        self.count = max(0, count)
        #: Whether a start that finds no idle spare gets one forked now rather than a fresh spawn.
        self.fork_on_demand = fork_on_demand
        self._launch = launch or SpareLaunch()
        self._output_limits = output or OutputLimits()
        self._idle: list[SpareProcess] = []
        self._spawning = 0
        self._failed_in_a_row = 0
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # One thread starts every spare: a start blocks for a few ms (the fork server's reply,
        # writing the preparation data; the first one also starts the fork server).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servewell-spares")
        self._tasks: set[asyncio.Task[None]] = set()
        self.adopted = 0  # spares handed to model loads since the start

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the idle spares (started, not yet adopted)."""
        return tuple(s.pid for s in self._idle if s.pid is not None)

    @property
    def ready_pids(self) -> tuple[int, ...]:
        """Process ids of the idle spares that have imported the runtime."""
        return tuple(s.pid for s in self._idle if s.pid is not None and s.ready is not None)

    def start(self) -> None:
        """Begin filling the set (call on the engine's event loop); returns at once. With
        `fork_on_demand` and no spares to keep, one spare is forked now all the same: the fork server
        starts (its imports) while the engine reads its repository, and the first model takes it."""
        self._loop = asyncio.get_running_loop()
        self._refill()
        if self.fork_on_demand and self.count == 0 and not self._spawning:
            self._spawning += 1
            self._spawn_task(self._spawn_one())

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until `count` spares are idle and ready (tests, benchmarks); `TimeoutError` after
        `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while len(self.ready_pids) < self.count:
                await asyncio.sleep(0.02)

    def take(self, config: ModelConfig) -> SpareProcess | None:
        """An idle spare for a worker of `config`, now its caller's to start and stop; None when
        there is none or the model needs a fresh spawn. Ready spares go first; one still importing
        is better than a fresh spawn (it is further along). The caller calls `refill` once its load
        is over: a spare spawned meanwhile would take the cores the load needs (measured: a ResNet-50
        session took 1.3 s to build beside a spare's start, 0.35 s alone, on 2 cores)."""
        if self._stopped or self._loop is None or fresh_spawn_reason(config) is not None:
            return None
        chosen = None
        for spare in sorted(self._idle, key=lambda s: s.ready is None):
            if spare.process.is_alive():  # waitpid(WNOHANG): never blocks
                chosen = spare
                break
        if chosen is None:
            return None
        self._idle.remove(chosen)
        self._unwatch(chosen)
        self.adopted += 1
        return chosen

    async def fork_for(self, config: ModelConfig) -> SpareProcess | None:
        """A spare forked now for a worker of `config` (the caller's, as from `take`), the fork
        server started first if it is not running yet; None when the model needs a fresh spawn, the
        set is stopping, or forking fails (the start then spawns its worker). A fork costs about
        10 ms of CPU against 0.8 s for a fresh interpreter and its imports (`spare.py`'s doc), which
        a start of many models paid once per worker, each taking the cores the others loaded on
        (issue 45: 13 python models on 2 cores)."""
        if self._stopped or self._loop is None or fresh_spawn_reason(config) is not None:
            return None
        if self._failed_in_a_row >= MAX_FAILED_SPARES:
            return None
        loop = asyncio.get_running_loop()
        try:
            spare = await loop.run_in_executor(self._spawner, self._spawn_blocking)
        except Exception as exc:
            self._failed(f"could not be forked for model {config.name}: {exc}", refill=False)
            return None
        if self._stopped:
            await self._end(spare, 0.0)
            return None
        if spare.output is not None:
            spare.output.relabel(f"spare worker {spare.pid}", pid=spare.pid)
            spare.output.start(loop)
        self.adopted += 1
        return spare

    def refill(self) -> None:
        """Start spares in the background until there are `count` (a load that took one is over)."""
        self._refill()

    def _refill(self) -> None:
        if self._stopped or self._loop is None or self._failed_in_a_row >= MAX_FAILED_SPARES:
            return
        while len(self._idle) + self._spawning < self.count:
            self._spawning += 1
            self._spawn_task(self._spawn_one())

    async def _spawn_one(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            spare = await loop.run_in_executor(self._spawner, self._spawn_blocking)
        except Exception as exc:  # a failed spawn costs a spare, never a model load
            self._spawning -= 1
            self._failed(f"could not be started: {exc}")
            return
        self._spawning -= 1
        if self._stopped:
            await self._end(spare, 0.0)
            return
        if spare.output is not None:
            spare.output.relabel(f"spare worker {spare.pid}", pid=spare.pid)
            spare.output.start(loop)
        self._idle.append(spare)
        loop.add_reader(spare.conn.fileno(), self._on_readable, spare)
        spare.watched = True

    def _spawn_blocking(self) -> SpareProcess:
        ctx = _fork_server()
        parent, child = ctx.Pipe(duplex=True)
        read_fd, output = output_pipe()
        process = ctx.Process(target=run_child, args=(output, run_spare, child, self._launch),
                              name="servewell-worker-spare", daemon=True)
        try:
            spawn(process, "spare", jemalloc=False)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            child.close()
            output.close()
        return SpareProcess(process, parent, WorkerOutput(read_fd, self._output_limits, "spare worker"))

    def _on_readable(self, spare: SpareProcess) -> None:
        try:
            while not spare.conn.closed and spare.conn.poll():
                message = receive_message(spare.conn)
                if isinstance(message, SpareReady):
                    spare.ready = message
                    self._failed_in_a_row = 0
                    log.info("spare worker %d ready (runtime imported in %.2f s)", message.pid, message.import_s,
                             extra={"event": "spare_ready", "pid": message.pid,
                                    "import_s": round(message.import_s, 3)})
        except (EOFError, OSError):
            self._unwatch(spare)
            if spare in self._idle:
                self._idle.remove(spare)
            self._failed(f"process {spare.pid} exited while idle (exit code {spare.process.exitcode})")
            self._spawn_task(self._end(spare, 0.0))

    def _failed(self, why: str, refill: bool = True) -> None:
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_SPARES:
            log.error("spare worker %s; %d in a row, so no more spares are started (loads spawn their workers)",
                      why, self._failed_in_a_row, extra={"event": "spare_failed"})
            return
        log.warning("spare worker %s%s", why, "; starting another" if refill else "", extra={"event": "spare_failed"})
        if refill:
            self._refill()

    def _unwatch(self, spare: SpareProcess) -> None:
        if spare.watched and self._loop is not None and not spare.conn.closed:
            self._loop.remove_reader(spare.conn.fileno())
        spare.watched = False

    def _spawn_task(self, coroutine: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)  # keep a reference until it finishes; `stop` waits for them
        task.add_done_callback(self._tasks.discard)

    async def _end(self, spare: SpareProcess, grace_s: float) -> None:
        """Close its pipe (it exits on EOF), kill it after `grace_s`, reap it off the loop."""
        self._unwatch(spare)
        spare.conn.close()
        loop = asyncio.get_running_loop()
        if grace_s > 0:
            await loop.run_in_executor(None, spare.process.join, grace_s)
        if spare.process.is_alive():
            spare.process.kill()
        await loop.run_in_executor(None, spare.process.join, 5.0)
        if spare.output is not None:
            spare.output.close()
            spare.output = None

    async def stop(self) -> None:
        """End every idle spare and start no more (the engine is stopping); returns once they exited.
        Call it after the models' workers stopped: a spare taken by a load ends when that load's
        handle closes its pipe."""
        self._stopped = True
        idle, self._idle = self._idle, []
        # A spawn in flight is waited for, not cancelled: it sees `_stopped` and ends its process.
        await asyncio.gather(*self._tasks, *(self._end(s, STOP_GRACE_S) for s in idle), return_exceptions=True)
        await asyncio.to_thread(self._spawner.shutdown, wait=True)
