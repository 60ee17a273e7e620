"""Starting a worker process, learning that it exited without blocking the event loop, ending what it left.

`output_pipe` makes the pipe its stdout and stderr go to (read by `worker_output.WorkerOutput`;
the child puts it in place: `child_main.run_child`). `spawn` starts it with SIGINT and SIGTERM
blocked (so a signal meant for the frontend's shutdown plan cannot reach it before it ignores
them), without multiprocessing's re-import of the main module, and, when asked, with jemalloc
preloaded into the child only. `watch_exit` tells when a
process has exited through a pidfd the loop watches, so the loop never waits in `process.join`.
`end_group` kills what is left of the process group a worker leads (whatever its model forked).
"""

from __future__ import annotations

import asyncio
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from multiprocessing.connection import Connection

from servewell.workers.entry import WORKER_IGNORED_SIGNALS

log = logging.getLogger("servewell.workers")

_JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)
_spawn_lock = threading.Lock()
#: What `spawn` shows multiprocessing as the main module while it starts a process: one with no
#: file and no spec, which the child then does not re-import.
_BARE_MAIN = types.ModuleType("__main__")


def find_jemalloc() -> str | None:
    """Path of libjemalloc if the machine has it."""
    for path in _JEMALLOC_PATHS:
        if os.path.exists(path):
            return path
    found = ctypes.util.find_library("jemalloc")
    return found if found and os.path.isabs(found) else None


def output_pipe() -> tuple[int, Connection]:
    """A pipe for a worker's stdout and stderr: the engine's read end (a descriptor), and the write
    end as a `Connection`, which multiprocessing hands to the child when it is among the process's
    arguments (spawn and the fork server alike); close it here once the process has started."""
    read_fd, write_fd = os.pipe()
    return read_fd, Connection(write_fd, readable=False)


def end_group(pid: int | None) -> None:
    """SIGKILL every process left in the process group that worker `pid` made its own
    (`child_main.run_child`): what its model forked. Called as the worker is killed, or once it has
    exited (its pid, which names the group, cannot be reused while a process of the group lives);
    nothing when the group is gone or was never made."""
    if pid:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def spawn(process: multiprocessing.process.BaseProcess, model: str, jemalloc: bool) -> None:
    """Start `process` with SIGINT and SIGTERM blocked (the child inherits the mask and ignores them
    before unblocking); with `jemalloc`, preloaded into the child only."""
    preload = None
    if jemalloc:
        preload = find_jemalloc()
        if preload is None:
            log.warning("model %s: allocator jemalloc requested but libjemalloc is not installed "
                        "(Debian: libjemalloc2); using the system allocator", model)
    with _spawn_lock:
        # A signal sent to the frontend meanwhile stays pending and is handled when unblocked.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
        previous = os.environ.get("LD_PRELOAD")
        main = sys.modules.get("__main__")
        try:
            if preload is not None:
                # spawn execs a fresh interpreter with this process's environment: set it just for the start.
                os.environ["LD_PRELOAD"] = preload if not previous else f"{preload}:{previous}"
            # multiprocessing would have the child re-import our main module (`servewell.engine_main`
            # in a split server: fastapi, uvicorn, the whole server) before it runs a line of the
            # worker, which needs none of it and is passed nothing defined there. Measured: a fresh
            # worker's spawn step took 2.1-2.4 s in the split server, 0.3 s in the single-process one
            # (whose `servewell.__main__` multiprocessing already skips), on the loaded 2-core machine.
            if main is not None:
                sys.modules["__main__"] = _BARE_MAIN
            process.start()
        finally:
            if main is not None:
                sys.modules["__main__"] = main
            if preload is not None:
                if previous is None:
                    os.environ.pop("LD_PRELOAD", None)
                else:
                    os.environ["LD_PRELOAD"] = previous
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def watch_exit(loop: asyncio.AbstractEventLoop, process: multiprocessing.process.BaseProcess, grace_s: float,
               settled: Callable[[], None]) -> None:
    """Call `settled` once, on the loop, when `process`'s exit code can be read without waiting
    (`process.exitcode`) or `grace_s` later, whichever comes first. Never blocks the loop:
    `process.join` would, for as long as a process that closed its sentinel lives, whatever its timeout.

    Two signals are watched: the process's pidfd (readable once it exited: a spawned child can then be
    reaped) and its sentinel. A worker forked by the fork server (workers/spare.py) is the fork
    server's child: its exit code reaches us only when the fork server has reaped it and written the
    code to the sentinel, a moment after the pidfd fired; settling on the pidfd alone read no code and
    killed a process that was already dead ("did not exit within 5 s")."""
    try:
        pidfd = os.pidfd_open(process.pid or 0)
    except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+), or already reaped: a thread waits
        waiter = loop.run_in_executor(None, process.join, grace_s)
        waiter.add_done_callback(lambda _: settled())
        return
    watched = {pidfd}
    try:
        watched.add(process.sentinel)
    except ValueError:  # not started, or closed
        pass

    def settle() -> None:
        for fd in watched:
            loop.remove_reader(fd)
        watched.clear()
        os.close(pidfd)
        overdue.cancel()
        settled()

    def readable(fd: int) -> None:
        if process.exitcode is not None:  # waitpid(WNOHANG) or the fork server's word: never blocks
            settle()
            return
        loop.remove_reader(fd)  # it stays readable: each signal is heard once, the other (or the grace) settles
        watched.discard(fd)

    for fd in watched:
        loop.add_reader(fd, readable, fd)
    overdue = loop.call_later(grace_s, settle)
