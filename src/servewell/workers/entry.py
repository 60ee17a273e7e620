"""The function a worker process starts in.

The frontend names it as the spawn target, so it must import without pulling in the worker's
side (runtimes, frameworks): the real entry point is imported only inside the new process.
"""

from __future__ import annotations

import signal
import time
from typing import Any

#: Signals a worker ignores. Ctrl-C in a terminal, `systemctl stop`, a container runtime's stop and
#: `kill -TERM -<pgid>` reach the whole process group, but the frontend decides when its workers
#: stop: after the drain, so that every accepted request is answered.
WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_worker(conn: Any, config: Any, launch: Any) -> None:
    """Worker process entry: hands its arguments to `process_main.worker_main`."""
    began_at = time.monotonic()  # the interpreter is up: the load's spawn step ends here
    _ignore_stop_signals()
    from servewell.workers.process_main import worker_main

    worker_main(conn, config, launch, began_at=began_at)


def run_spare(*args: Any) -> None:
    """Spare worker process entry: hands its arguments to `spare_main.spare_main`."""
    _ignore_stop_signals()
    from servewell.workers.spare_main import spare_main

    spare_main(*args)


def _ignore_stop_signals() -> None:
    for sig in WORKER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # The frontend blocks these signals while it spawns us, so that one arriving before the lines
    # above cannot end us; a pending one is discarded now that it is ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORED_SIGNALS)
