"""Threads for background work that must not take CPU from serving (heavy image decodes, model
snapshots, a worker's model load)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: The lowest priority Linux has (the highest nice value).
MAX_NICE = 19


def lower_priority_pool(threads: int, nice: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run `nice` steps below normal CPU priority (where the platform
    has per-thread priorities; elsewhere they run at normal priority)."""

    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lambda: _lower_this_thread(nice))


def call_at_lower_priority(fn: Callable[[], T], nice: int, name: str) -> T:
    """`fn()` run on a thread of its own `nice` steps below the caller's CPU priority; its result is
    returned and its exception raised here, in the caller, which waits. `nice` 0 (or a platform
    without per-thread priorities): `fn()` in the caller.

    Threads that `fn` starts inherit the lower priority, and an unprivileged process cannot raise a
    priority again: call it only where `fn` starts none that outlive it
    (`native_thread_ids` before and after tells)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return fn()
    outcome: list[tuple[bool, object]] = []

    def body() -> None:
        _lower_this_thread(nice)
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller, which raises it
            outcome.append((False, exc))

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    done, value = outcome[0]
    if not done:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


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


def _lower_this_thread(nice: int) -> None:
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):  # a sandbox may forbid it: then it runs at normal priority
            now = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: this thread's
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(MAX_NICE, now + nice))
