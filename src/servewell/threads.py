"""Thread pools for background work that must not take CPU from serving (heavy image decodes,
model snapshots)."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor


def lower_priority_pool(threads: int, nice: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run `nice` steps below normal CPU priority (where the platform
    has per-thread priorities; elsewhere they run at normal priority)."""

    def lower() -> None:
        if nice > 0 and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):  # a sandbox may forbid it: then it runs at normal priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)

    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower)
