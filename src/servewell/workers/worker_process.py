"""The operating-system side of one worker: its process, how it came to be (an idle spare
adopted, one forked on demand, or a fresh spawn), the pipe that carries what it prints, and how
it is ended and reaped with everything its model forked (its process group).

`WorkerHandle` (workers/handle.py) owns the worker's lifecycle as the engine sees it (loading,
ready, hung, lost), its channel and its heartbeat; this class changes when the ways of starting
and ending processes do (spares, fork servers, process groups, output forwarding).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection

from servewell.config.model import ModelConfig
from servewell.workers.child_main import run_child
from servewell.workers.entry import run_worker
from servewell.workers.messages import AdoptSpare, WorkerLaunch, send_message
from servewell.workers.output_cap import OutputLimits
from servewell.workers.process_start import end_group, output_pipe, spawn, watch_exit
from servewell.workers.spare import SpareProcess, SpareWorkers, why_fresh
from servewell.workers.worker_output import WorkerOutput


class StoppedBeforeStart(Exception):
    """The worker was stopped while a spare was being forked for it."""


class WorkerProcess:
    """One worker's process, once `launch` made it (or adopted it)."""

    __slots__ = ("_process", "_output")

    def __init__(self) -> None:
        self._process: multiprocessing.process.BaseProcess | None = None
        self._output: WorkerOutput | None = None

    @property
    def pid(self) -> int | None:
        """Its process id, once launched."""
        return self._process.pid if self._process else None

    @property
    def exitcode(self) -> int | None:
        """Its exit code once it has been reaped (read without waiting), else None."""
        return self._process.exitcode if self._process else None

    @property
    def launched(self) -> bool:
        """Whether a process was launched (or adopted)."""
        return self._process is not None

    async def launch(self, config: ModelConfig, launch: WorkerLaunch, spares: SpareWorkers | None,
                     output_limits: OutputLimits, stopped: Callable[[], bool]) -> tuple[SpareProcess | None, Connection,
                                                                                        str]:
        """An idle spare adopted, one forked now, or a fresh spawn running `config`'s worker.
        Returns the spare (None: spawned), the engine's end of its pipe, and why it was spawned
        ("" for a spare). `StoppedBeforeStart` when `stopped()` turned true while a spare was forked."""
        name = f"servewell-worker-{config.name}"
        spare = spares.take(config) if spares is not None else None
        if spare is None and spares is not None and spares.fork_on_demand:
            spare = await spares.fork_for(config)
            if spare is not None and stopped():
                spare.conn.close()  # it exits on EOF; PR_SET_PDEATHSIG covers the rest
                if spare.output is not None:
                    spare.output.close()
                raise StoppedBeforeStart("the worker was stopped before it started")
        if spare is not None:
            self._process, self._output = spare.process, spare.output
            try:
                send_message(spare.conn, AdoptSpare(config, launch, name))
            except (OSError, ValueError):
                pass  # it died just now: its pipe's EOF fails this start like a fresh worker's death
            return spare, spare.conn, ""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        read_fd, output = output_pipe()
        process = ctx.Process(target=run_child, args=(output, run_worker, child, config, launch), name=name,
                              daemon=True)
        self._process = process
        try:
            spawn(process, config.name, config.allocator == "jemalloc")
        finally:
            child.close()
            output.close()
        self._output = WorkerOutput(read_fd, output_limits, "")
        self._output.start(asyncio.get_running_loop())
        return None, parent, why_fresh(spares, config)

    def relabel(self, model: str, instance: int) -> None:
        """Name what it prints by its model, instance and pid from now on."""
        if self._output is not None:
            self._output.relabel(f"model {model} instance {instance} (worker {self.pid})", model=model,
                                 instance=instance, pid=self.pid)

    def watch_exit(self, loop: asyncio.AbstractEventLoop, grace_s: float, exited: Callable[[], None]) -> None:
        """Call `exited` once the process has exited (or `grace_s` passed), without waiting for it."""
        assert self._process is not None
        watch_exit(loop, self._process, grace_s, exited)

    def kill(self) -> None:
        """End it and everything its model forked at once."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            end_group(self._process.pid)

    def kill_unreaped(self) -> bool:
        """Kill it if it has not exited yet (it closed its pipe but lives on); whether it had to be."""
        if self._process is not None and self._process.exitcode is None:
            self._process.kill()
            return True
        return False

    def reap_later(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Collect a killed process off the event loop (it may take a moment to die)."""
        if self._process is not None and loop is not None:
            loop.run_in_executor(None, self._process.join, 10.0)

    async def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` (0: not at all) for it to exit; kill it (and its group) if it
        has not, and collect it."""
        process = self._process
        if process is None or process.pid is None:
            return
        loop = asyncio.get_running_loop()
        if timeout_s > 0:
            await loop.run_in_executor(None, _join_then_end_group, process, timeout_s)
        if process.is_alive():
            self.kill()
            await loop.run_in_executor(None, _join_then_end_group, process, 5.0)

    def end_group(self) -> None:
        """End what its model forked (its process group), once it has ended itself."""
        end_group(self.pid)

    def close_output(self) -> None:
        """Stop forwarding what it prints (what it wrote last, a crash's stack, is forwarded first)."""
        if self._output is not None:
            self._output.close()
            self._output = None


def _join_then_end_group(process: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    """Wait up to `timeout_s` for `process` to exit; once it has, end what is left of its group at
    once (in the same thread: its pid, which names the group, was just reaped and is not reused
    for a long while)."""
    process.join(timeout_s)
    if process.exitcode is not None:
        end_group(process.pid)
