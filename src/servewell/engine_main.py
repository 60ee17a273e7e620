"""The engine process of a split server: `python -m servewell.engine_main RUN_DIR`.

It runs what one servewell process ran before the split (model registry, schedulers, worker
pools, live config, console feed, alerting, metrics), minus the public listeners (the ingress
processes serve HTTP and gRPC; gRPC's model views and repository calls come back here as control
calls over the door): its HTTP app listens on the private unix socket RUN_DIR/engine-http.sock,
where the ingress processes forward every request that is not an inference request, and
inference arrives as envelopes at RUN_DIR/engine-door.sock (engine/door.py).

Signals (from the supervisor): SIGUSR1 begins the shutdown (readiness false, everything is still
served while the ingress processes drain); SIGTERM then drains what is queued and exits (no
further delay: the supervisor spent it in the ingress processes); SIGHUP re-reads the
configuration files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from servewell.allocator import bound_freed_memory
from servewell.api.peer import TrustedPeerMiddleware
from servewell.child_process import ENGINE_DOOR_SOCKET, ENGINE_HTTP_SOCKET, die_with_parent, read_settings
from servewell.engine_standby import standby_fd, wait_to_take_over
from servewell.observability.logging import configure_logging
from servewell.server import build_app, remove_leftovers, remove_own_segments
from servewell.shutdown import GracefulServer, ShutdownPlan, uvicorn_graceful_timeout_s
from servewell.workers.spare import start_fork_server, use_private_temp_dir

log = logging.getLogger("servewell.server")


class EngineServer(GracefulServer):
    """uvicorn on the private socket with the engine's signals (see the module doc)."""

    def __init__(self, config: uvicorn.Config, plan: ShutdownPlan) -> None:
        super().__init__(config, plan)
        self._begun = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGUSR1 begins the shutdown; SIGINT/SIGTERM drain and exit."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self._begin)
        with super().capture_signals():
            yield
        loop.remove_signal_handler(signal.SIGUSR1)

    def _begin(self) -> None:
        if not self._begun:
            self._begun = True
            self._plan.begin("SIGUSR1", self._plan.delay_s)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self._begun:
            self._begun = True
            self._plan.begin(sig.name, 0.0)
            self.should_exit = True
            return
        if not self.should_exit:
            self.should_exit = True  # the drain starts now
            return
        log.warning("%s again: stopping now", sig.name)
        self._plan.abort(f"a second {sig.name}")  # what still waits gets 503 shutting_down


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
        if read_settings(run_dir)[0].fork_worker_starts:
            use_private_temp_dir(run_dir / "multiprocessing")
            start_fork_server()  # its imports too are done before the engine dies
        if not wait_to_take_over(standby):
            return 0  # never needed: the supervisor stopped
    settings, source = read_settings(run_dir)
    configure_logging(settings.log_level, settings.log_format)
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
    app, plan = build_app(settings, source, door_path=str(run_dir / ENGINE_DOOR_SOCKET))
    http_socket = str(run_dir / ENGINE_HTTP_SOCKET)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(http_socket)
    config = uvicorn.Config(TrustedPeerMiddleware(app), uds=http_socket, log_config=None, access_log=False,
                            timeout_graceful_shutdown=uvicorn_graceful_timeout_s(plan), lifespan="on",
                            timeout_keep_alive=300)
    started = time.monotonic()
    try:
        EngineServer(config, plan).run()
    finally:
        remove_own_segments()
        log.info("engine process exits after %.1f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
