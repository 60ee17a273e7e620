"""The engine process of a split server: `python -m servewell.engine_main RUN_DIR`.

It runs what one servewell process ran before the split (model registry, schedulers, worker
pools, live config, console feed, alerting, metrics), minus the listeners: the ingress processes
serve every HTTP and gRPC route, and everything reaches the engine at one private unix socket,
RUN_DIR/engine-door.sock (engine/door.py): inference as envelopes, every admin, repository,
metadata and view operation as one typed control operation (engine/control.py). It has no HTTP
app.

Signals (from the supervisor): SIGUSR1 begins the shutdown (readiness false, everything is still
served while the ingress processes drain); SIGTERM then drains what is queued and exits (no
further delay: the supervisor spent it in the ingress processes); SIGHUP re-reads the
configuration files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from servewell.allocator import bound_freed_memory
from servewell.child_process import ENGINE_DOOR_SOCKET, die_with_parent, read_settings
from servewell.engine_standby import standby_fd, wait_to_take_over
from servewell.observability.logging import configure_logging
from servewell.observability.process_title import set_process_title
from servewell.server import EngineSide, build_engine, remove_leftovers, remove_own_segments
from servewell.workers.spare import start_fork_server, use_private_temp_dir

log = logging.getLogger("servewell.server")


class EngineRunner:
    """Runs the engine side until the supervisor stops it (see the module doc for the signals):
    startup, serve until told to exit, then the drain and the shutdown within the plan's timeout."""

    def __init__(self, side: EngineSide) -> None:
        self._side = side
        self._plan = side.plan
        self._begun = False
        self._exit: asyncio.Event | None = None

    def run(self) -> None:
        """Serve on a fresh event loop (uvloop's, as uvicorn ran the engine before) until it exits."""
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, self._begin)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self._side.startup()
            await self._exit.wait()
        finally:
            # The drain: what is queued is answered (503 shutting_down for what is still waiting
            # after --shutdown-timeout-s), then the workers stop.
            deadline = loop.call_later(self._plan.timeout_s, self._plan.abort,
                                       f"the drain took longer than --shutdown-timeout-s ({self._plan.timeout_s:g} s)")
            self._plan.listeners_closed()
            try:
                await self._side.shutdown()
            finally:
                deadline.cancel()
                for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    def _begin(self) -> None:
        if not self._begun:
            self._begun = True
            self._plan.begin("SIGUSR1", self._plan.delay_s)

    def _on_signal(self, sig: signal.Signals) -> None:
        assert self._exit is not None
        if not self._begun:
            self._begun = True
            self._plan.begin(sig.name, 0.0)
            self._exit.set()
            return
        if not self._exit.is_set():
            self._exit.set()  # the drain starts now
            return
        log.warning("%s again: stopping now", sig.name)
        self._plan.abort(f"a second {sig.name}")  # what still waits gets 503 shutting_down


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it on Linux; plain asyncio elsewhere
        return None
    return uvloop.new_event_loop


def seconds_since_exec() -> float | None:
    """Seconds since this process started (the kernel's start time; None where /proc cannot say):
    at the top of `main`, what the interpreter's start and the imports took."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))


def main(argv: list[str]) -> int:
    """Run the engine until the supervisor stops it."""
    imported_s = seconds_since_exec()
    run_dir = Path(argv[1])
    die_with_parent()
    standby = standby_fd(argv)
    if standby is not None:  # engine_standby.py
        set_process_title("servewell standby engine")  # its name stays sw-standby while it waits
        if read_settings(run_dir)[0].fork_worker_starts:
            use_private_temp_dir(run_dir / "multiprocessing")
            start_fork_server()  # its imports too are done before the engine dies
        if not wait_to_take_over(standby):
            return 0  # never needed: the supervisor stopped
    settings, source = read_settings(run_dir)
    configure_logging(settings.log_level, settings.log_format)
    set_process_title("servewell engine")  # ps and top tell it from the ingress processes and workers
    # Where a restart's time goes (issue 45 H15): this is the interpreter and the imports (none for a
    # standby taking over: done while it waited); the models' loads are logged each
    # (worker_cold_start), the ingress processes' reconnects too.
    if standby is not None:
        imported_s = 0.0
    log.info("engine process %d up%s: interpreter and imports took %s", os.getpid(),
             " (a standby taking over)" if standby is not None else "",
             "an unknown time" if imported_s is None else f"{imported_s:.2f} s",
             extra={"event": "engine_up", "imports_s": None if imported_s is None else round(imported_s, 3),
                    "standby": standby is not None})
    remove_leftovers(settings)
    bound_freed_memory()
    use_private_temp_dir(run_dir / "multiprocessing")  # the spares' fork server's socket
    side = build_engine(settings, source, door_path=str(run_dir / ENGINE_DOOR_SOCKET))
    started = time.monotonic()
    try:
        EngineRunner(side).run()
    finally:
        remove_own_segments()
        log.info("engine process exits after %.1f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
