"""What every worker process (and spare) does first and last, around its real entry point.

First: its stdout and stderr become the pipe the engine reads (`worker_output.py`, which caps what
reaches the log); it becomes the leader of a process group of its own, and a child subreaper
(PR_SET_CHILD_SUBREAPER), so that whatever a model forks stays findable: in its group, and, once
orphaned, a child of the worker rather than of init. Last, after a clean exit: it kills every
child it still has, round after round as orphans come back to it, so a daemon a model started
(its own session, its parent gone) ends with the worker. A worker killed outright cannot do that;
the engine then kills its process group (`process_start.end_group`), which holds everything the
model forked but what left the group (setsid): the one thing only a cgroup would catch.

Measured before (issue 45): a sleeper a python model forked outlived a clean server stop, and kept
the engine's multiprocessing resource tracker alive 90 s through the descriptor it inherited.

Imports nothing heavy: a spawned worker runs this before its entry point's imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

_PR_SET_CHILD_SUBREAPER = 36
#: Rounds of killing children at exit (each waits for the killed ones to be gone, so their own
#: orphans come back to this process in time for the next).
END_ROUNDS = 20
#: Longest the kills at exit may take in all.
END_WITHIN_S = 2.0


def run_child(output: Connection | None, target: Callable[..., Any], *args: Any) -> None:
    """Put the worker's stdout and stderr on `output` (None: keep them), make it a group leader and
    a subreaper, run `target(*args)`, then end what it forked."""
    if output is not None:
        fd = output.fileno()
        os.dup2(fd, 1)  # dup2 clears close-on-exec: the model's own children write there too
        os.dup2(fd, 2)
        output.close()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        target(*args)
    finally:
        end_children()


def end_children(within_s: float = END_WITHIN_S) -> int:
    """SIGKILL every child of this process, again as long as new ones appear (orphans coming back
    to a subreaper), for at most `within_s`; how many were killed."""
    killed = 0
    give_up_at = time.monotonic() + within_s
    for _ in range(END_ROUNDS):
        children = children_of_self()
        if not children:
            break
        for pid in children:
            with contextlib.suppress(OSError):  # our unreaped child: its pid cannot be anyone else's
                os.kill(pid, signal.SIGKILL)
                killed += 1
        for pid in children:
            _reap(pid, give_up_at)
        if time.monotonic() >= give_up_at:
            break
    return killed


def children_of_self() -> list[int]:
    """This process's children (every thread's), from /proc; empty where it cannot be read."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    return pids


def _reap(pid: int, give_up_at: float) -> None:
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped already (by the model's own code, say)
        if done or time.monotonic() >= give_up_at:
            return
        time.sleep(0.002)


def _prctl(option: int, value: int) -> None:
    # The interpreter's own symbols include libc's: no `find_library`, which runs ldconfig in a child.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
