"""Stopping like a real service: readiness first, then the listeners, then a bounded drain, then workers.

On the first SIGTERM (what Kubernetes, systemd and `docker stop` send):

1. readiness turns false at once (`/v2/health/ready`, `/healthz` answer 503) and no worker is
   restarted from now on, but the server keeps accepting and serving for `shutdown_delay_s`
   (default 5 s): load balancers notice and stop sending before anything is refused; the gRPC
   listener sends every connection GOAWAY and refuses new ones at once (its calls in flight finish);
2. the HTTP listener closes (gRPC's already did): new connections are refused, idle keep-alive
   connections closed, and every request already accepted is finished: the drain, at most
   `shutdown_timeout_s` (default 20 s); what is still waiting then is answered 503 `shutting_down`;
3. the workers, idle by then, are told to exit (killed after 2 s, at once if the drain was cut
   short); queued spans get at most 1 s to reach the collector; the process exits with status 0.

SIGINT (Ctrl-C at a terminal) skips the delay. A second SIGTERM or SIGINT cuts everything short:
waiting requests are answered 503 `shutting_down` and the workers are killed. Workers ignore
SIGINT and SIGTERM themselves (a signal to the whole process group reaches them too): only the
frontend stops them, after the drain. Worst case from the first SIGTERM to exit with the defaults:
5 + 20 + about 1 s, inside Kubernetes' default 30 s grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

import uvicorn

log = logging.getLogger("servewell.server")

#: Seconds idle workers get to exit after the drain before they are killed.
WORKER_STOP_S = 2.0
#: Extra seconds uvicorn waits for connections after the drain deadline has answered everything.
_UVICORN_MARGIN_S = 2.0


class ShutdownTarget(Protocol):
    """What a shutdown drives: the engine."""

    def begin_shutdown(self) -> None:
        """Readiness false, nothing restarts; requests are still served."""
        ...

    def abort(self, why: str) -> None:
        """Answer everything still waiting with 503 shutting_down."""
        ...


class ShutdownPlan:
    """The shared state of one server's shutdown: the signal handlers, the HTTP server and the
    app's lifespan all read it."""

    def __init__(self, target: ShutdownTarget, delay_s: float, timeout_s: float) -> None:
        self.target = target
        self.delay_s = delay_s
        self.timeout_s = timeout_s
        self.requested_at: float | None = None
        self.aborted = False
        self._listeners_closed: list[Callable[[], None]] = []
        self._begun: list[Callable[[], None]] = []

    def on_begin(self, callback: Callable[[], None]) -> None:
        """Call `callback` when readiness turns false (e.g. to send gRPC clients GOAWAY)."""
        self._begun.append(callback)

    def on_listeners_closed(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the drain starts (e.g. to stop the gRPC listener too)."""
        self._listeners_closed.append(callback)

    def begin(self, signal_name: str, delay_s: float) -> None:
        """The first signal: readiness false, keep serving `delay_s` seconds."""
        self.requested_at = time.monotonic()
        self.target.begin_shutdown()
        for callback in self._begun:
            callback()
        log.info("%s: shutting down; readiness is false, serving %.1f s more before the listeners close, then "
                 "draining for at most %.1f s", signal_name, delay_s, self.timeout_s,
                 extra={"signal": signal_name, "delay_s": delay_s, "timeout_s": self.timeout_s})

    def listeners_closed(self) -> None:
        """The drain starts now."""
        log.info("listeners closed; finishing the requests already accepted")
        for callback in self._listeners_closed:
            callback()

    def abort(self, why: str) -> None:
        """Stop waiting: answer what is left with 503 shutting_down; workers are then killed."""
        if self.aborted:
            return
        self.aborted = True
        log.warning("shutdown cut short (%s): requests still waiting get 503 shutting_down", why)
        self.target.abort(why)

    @property
    def worker_stop_s(self) -> float:
        """How long idle workers get to exit (0 after an abort: they may hold a batch nobody waits for)."""
        return 0.0 if self.aborted else WORKER_STOP_S


class GracefulServer(uvicorn.Server):
    """uvicorn with servewell's shutdown order (see the module doc), and exit status 0 after a
    signal (uvicorn re-raises the signal after its shutdown, which ends the process with -SIGTERM)."""

    def __init__(self, config: uvicorn.Config, plan: ShutdownPlan) -> None:
        super().__init__(config)
        self._plan = plan
        self._exit_at: float | None = None
        self._signals = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM go to `_on_signal` on the event loop; nothing is re-raised at exit."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: object) -> None:
        """uvicorn's own entry point for signals, kept for callers that use it."""
        self._on_signal(signal.Signals(sig))

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            delay_s = self._plan.delay_s if sig == signal.SIGTERM else 0.0
            self._plan.begin(sig.name, delay_s)
            # Readiness is false: every HTTP/1.1 answer from now on closes its connection (api/http_limits.py).
            close_after_answers = getattr(self.config.http_protocol_class, "close_after_answers", None)
            if close_after_answers is not None:
                close_after_answers(self.server_state.connections)
            self._exit_at = time.monotonic() + delay_s
            if delay_s == 0:
                self.should_exit = True
            return
        log.warning("%s again: stopping now", sig.name)
        self.should_exit = True
        self._plan.abort(f"a second {sig.name}")

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop ticks every 0.1 s: the delay ends on a tick."""
        if self._exit_at is not None and time.monotonic() >= self._exit_at:
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Close the listeners, drain within the plan's timeout, then run the app's shutdown."""
        plan = self._plan
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(plan.timeout_s, plan.abort,
                                   f"the drain took longer than --shutdown-timeout-s ({plan.timeout_s:g} s)")
        plan.listeners_closed()
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def uvicorn_graceful_timeout_s(plan: ShutdownPlan) -> int:
    """uvicorn's own limit on waiting for connections (whole seconds): a backstop behind the plan's
    deadline (by then every request has been answered, so connections close on their own)."""
    return math.ceil(plan.timeout_s + _UVICORN_MARGIN_S)


async def run_after_drain(plan: ShutdownPlan, stop: Callable[[float], Awaitable[None]]) -> None:
    """Stop the workers once the drain is over (`stop(worker_timeout_s)`), and say how long it took."""
    await stop(plan.worker_stop_s)
    if plan.requested_at is not None:
        log.info("shutdown finished %.1f s after the signal", time.monotonic() - plan.requested_at)
