"""CPU priorities of threads: pools for background work that must not take CPU from serving
(heavy image decodes, model snapshots), a worker's `nice`, and a stopping worker's teardown at
idle priority."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

#: The lowest priority Linux has (the highest nice value).
MAX_NICE = 19


def lower_priority_pool(threads: int, nice: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run `nice` steps below normal CPU priority (where the platform
    has per-thread priorities; elsewhere they run at normal priority)."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name,
                              initializer=lambda: _lower_thread(threading.get_native_id(), nice))


def lower_every_thread(nice: int) -> None:
    """Lower every thread of this process `nice` steps (Linux priorities are per thread: `os.nice`
    lowers only its caller's, and the threads a library started at import, OpenBLAS's among them,
    would keep theirs). Threads started later inherit their starter's."""
    for tid in native_thread_ids() or {threading.get_native_id()}:
        _lower_thread(tid, nice)


def native_thread_ids() -> set[int]:
    """The kernel's ids of this process's threads now (empty where /proc is not)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _lower_thread(tid: int, nice: int) -> None:
    """Thread `tid` of this process `nice` steps lower (no further than the lowest priority)."""
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):  # it ended meanwhile, or a sandbox forbids it: it stays as it is
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def idle_every_thread() -> bool:
    """Every thread of this process to SCHED_IDLE (Linux): a woken thread of any normal process
    preempts them at once, whatever the niceness says. For a process that will do nothing but
    stop: an unprivileged process cannot leave SCHED_IDLE again. False where none could be moved
    (no SCHED_IDLE on this platform, or a sandbox forbids it)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    moved = False
    for tid in native_thread_ids() or {threading.get_native_id()}:
        with contextlib.suppress(OSError):  # it ended meanwhile, or a sandbox forbids it
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            moved = True
    return moved
