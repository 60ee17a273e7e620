"""The function a worker process starts in.

The frontend names it as the spawn target, so it must import without pulling in the worker's
side (runtimes, frameworks): the real entry point is imported only inside the new process.
"""

from __future__ import annotations

from typing import Any


def run_worker(*args: Any) -> None:
    """Worker process entry: hands its arguments to `process_main.worker_main`."""
    from servewell.workers.process_main import worker_main

    worker_main(*args)
