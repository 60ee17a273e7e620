"""Thread pools for background work that must not take CPU from serving (heavy image decodes,
model snapshots)."""

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

    def lower() -> None:
        if nice > 0 and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):  # a sandbox may forbid it: then it runs at normal priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)

    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower)


def lower_every_thread(nice: int) -> None:
    """Lower every thread of this process `nice` steps (Linux priorities are per thread: `os.nice`
    lowers only its caller's, and the threads a library started at import, OpenBLAS's among them,
    would keep theirs). Threads started later inherit their starter's."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    for tid in native_thread_ids() or {threading.get_native_id()}:
        with contextlib.suppress(OSError):  # it ended meanwhile, or a sandbox forbids it
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def native_thread_ids() -> set[int]:
    """The kernel's ids of this process's threads now (empty where /proc is not)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()
