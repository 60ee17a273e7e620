"""Entry point of a spare worker process: come up, import the runtime, wait to be given a model.

The engine keeps a few of these (`workers/spare.py`) so that a model load skips the interpreter
start and the runtime imports. Given `AdoptSpare`, the process becomes an ordinary worker
(`process_main.worker_main`) with the model's config and launch, exactly as a freshly spawned
one would be: nice, CPU affinity, thread counts and the device are all applied by `worker_main`.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from servewell.config.runtimes import runtime_descriptor
from servewell.observability.logging import configure_logging
from servewell.observability.process_title import set_process_title
from servewell.workers.backends import SPARE_RUNTIME, import_backend
from servewell.workers.messages import AdoptSpare, SpareLaunch, SpareReady, receive_message, send_message
from servewell.workers.process_main import worker_main

_PR_SET_PDEATHSIG = 1


def spare_main(conn: Connection, launch: SpareLaunch) -> None:
    """Import the runtime, say `SpareReady`, then become the worker of the model `AdoptSpare`
    names; exit on anything else (`Shutdown`, the engine gone)."""
    parent = os.getppid()
    # Killed with the process that forked it (the fork server, which lives as long as the engine;
    # a spare started without one is a child of the engine's spawning thread): an idle spare holds
    # nothing worth a graceful exit. Pipe EOF ends it too, once it reads.
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)
    configure_logging(launch.log_level, launch.log_format)
    set_process_title("servewell spare worker")  # until adopted: then worker_main names the model it serves
    began = time.monotonic()
    import_backend(runtime_descriptor(SPARE_RUNTIME))
    try:
        send_message(conn, SpareReady(os.getpid(), time.monotonic() - began))
        message = receive_message(conn)
    except (EOFError, OSError):
        return  # the engine is gone
    if not isinstance(message, AdoptSpare):
        return  # Shutdown: the spare set is stopping
    adopted_at = time.monotonic()
    # From now on this is a worker like any other: it outlives the thread that spawned it and ends
    # when its pipe closes (the engine's exit) or it is told to.
    _parent_death_signal(0)
    multiprocessing.current_process().name = message.process_name
    worker_main(conn, message.config, message.launch, began_at=adopted_at)


def _parent_death_signal(sig: int) -> None:
    """Ask the kernel for `sig` when the thread that spawned this process ends (0: no signal)."""
    # The interpreter's own symbols include libc's prctl: `ctypes.util.find_library` would run
    # ldconfig in a child process at every spare's start (tens of ms, more on a busy machine).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
