"""An ingress process of a split server: `python -m servewell.ingress_main RUN_DIR INDEX FD`.

It accepts HTTP connections on the listening socket FD (inherited from the supervisor; every
ingress process accepts from the same socket, so the kernel spreads connections across them and
a restarted one takes up where the dead one stopped) and serves every route itself, doing the
per-request work that scales with processes: HTTP parsing and its limits, request ids, API keys
and rate limits, the access rule, body limits, JSON/binary/image decoding, validation, encoding,
metrics and logs of the request. Inference goes to the engine as envelopes
(api/remote_engine.py); every admin, repository, metadata and view operation (health, /metrics,
the console's state) as one typed control operation over the same door (engine/control.py,
api/control_plane.py), answered by the engine, so those answers are the engine's whichever
ingress a client reached; docs, the console page and liveness are answered here. gRPC (OIP v2) is
served here too, on the gRPC port every ingress binds with SO_REUSEPORT (`IngressGrpc`).

SIGTERM: readiness false for shutdown_delay_s (the engine, told at the same moment, says so on
every health route), then the listener closes and what was accepted drains; SIGINT skips the delay.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from servewell.api.app import create_app
from servewell.api.codecs.image import ImageLimits
from servewell.api.control_plane import DoorControlPlane
from servewell.api.dataplane import DataPlane
from servewell.api.early_refusal import EarlyRefusal
from servewell.api.grpc.listener import GrpcListener, build_grpc_listener, call_slots
from servewell.api.grpc.scope import RpcScope
from servewell.api.grpc.servicer import InferenceServicer
from servewell.api.http_limits import uvicorn_limit_options
from servewell.api.keys import InferenceAccess
from servewell.api.remote_engine import RemoteEngine
from servewell.api.state import AppState, LiveKnobs
from servewell.child_process import ENGINE_DOOR_SOCKET, die_with_parent, read_settings
from servewell.config.server import ConfigFileError, ServerConfig
from servewell.engine.envelope import LiveSettings
from servewell.errors import ShuttingDown
from servewell.live_config import load_keys
from servewell.observability.console_feed import ConsoleFeed
from servewell.observability.logging import configure_logging
from servewell.observability.metrics import ServeMetrics
from servewell.observability.process_title import set_process_title
from servewell.observability.tracing import Tracing, sample_ratio_or_default, settings_from
from servewell.server import build_decoder, tune_garbage_collector
from servewell.shutdown import GracefulServer, ShutdownPlan, uvicorn_graceful_timeout_s
from servewell.tenancy.keys import KeyFormatError

log = logging.getLogger("servewell.ingress")


class IngressShutdown:
    """What a shutdown drives in an ingress process (`ShutdownTarget`)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def begin_shutdown(self) -> None:
        """This ingress reports not ready; requests are still served."""
        self._engine.shutting_down = True

    def abort(self, why: str) -> None:
        """Answer every request still waiting on the engine with 503 shutting_down."""
        self._engine.fail_all(ShuttingDown(f"the server is shutting down: {why}"))


class IngressGrpc:
    """This ingress's share of the gRPC port (SO_REUSEPORT: every ingress binds it and the kernel
    spreads connections across them): GOAWAY to every connection when the shutdown begins (clients
    go elsewhere while calls in flight finish within the delay and the drain)."""

    def __init__(self, settings: ServerConfig, plan: ShutdownPlan, servicer: InferenceServicer,
                 scope: RpcScope) -> None:
        self._plan = plan
        self._listener: GrpcListener | None = None
        if settings.grpc_port:
            self._listener = build_grpc_listener(settings, servicer, scope, reuse_port=True)
        self._stopping: list[asyncio.Task[None]] = []
        plan.on_begin(self.stop)
        plan.on_listeners_closed(self.stop)

    async def start(self) -> None:
        """Listen (`OSError` when the port cannot be bound)."""
        if self._listener is not None:
            await self._listener.start()

    def stop(self) -> None:
        """GOAWAY now; calls in flight get the shutdown delay and drain to finish."""
        if self._listener is not None and not self._stopping:
            grace_s = self._plan.delay_s + self._plan.timeout_s
            self._stopping.append(asyncio.get_running_loop().create_task(self._listener.stop(grace_s)))

    async def stopped(self) -> None:
        """Stop (if not yet) and wait until the listener has."""
        self.stop()
        await asyncio.gather(*self._stopping)


def build_ingress(settings: ServerConfig, run_dir: Path, index: int) -> tuple[ASGIApp, ShutdownPlan]:
    """The ingress app and its shutdown plan."""
    try:
        keys = load_keys(settings)
    except (KeyFormatError, OSError) as exc:
        raise ConfigFileError(f"API keys: {exc}") from None
    metrics = ServeMetrics(settings.latency_buckets_s) if settings.metrics_enabled else None
    tracing = Tracing(settings_from(settings.otlp_endpoint, settings.otlp_protocol, settings.trace_sample_ratio),
                      decides_roots=True)
    access = InferenceAccess(keys, settings.api_key_rate_per_s, metrics=metrics)
    knobs = LiveKnobs(settings.slow_request_ms / 1000.0, settings.metrics_require_key)
    console = ConsoleFeed(metrics)  # only its ring of recent requests is filled here; the engine reads it
    console.recent.slow_log.lines_per_window = settings.slow_request_lines_per_model

    def apply_live(live: LiveSettings) -> None:
        fresh: ServerConfig = live.settings
        access.replace(live.keys, live.default_rate_per_s)
        knobs.slow_request_s = fresh.slow_request_ms / 1000.0
        knobs.metrics_need_key = fresh.metrics_require_key
        tracing.set_sample_ratio(sample_ratio_or_default(fresh.trace_sample_ratio))
        logging.getLogger().setLevel(fresh.log_level.upper())

    engine = RemoteEngine(str(run_dir / ENGINE_DOOR_SOCKET), index, apply_live, view_snapshot=console.view.snapshot,
                          shared_min_bytes=settings.shared_tensor_min_bytes,
                          shared_limit_bytes=settings.shared_tensor_limit_bytes)
    decoder, pools = build_decoder(settings)
    plane = DataPlane(engine, decoder, ImageLimits(settings.max_image_pixels, settings.max_image_side), metrics,
                      tracing, access.tenant_of)
    plan = ShutdownPlan(IngressShutdown(engine), settings.shutdown_delay_s, settings.shutdown_timeout_s)
    control = DoorControlPlane(engine)
    scope = RpcScope(metrics, tracing, access, knobs, console.recent, call_slots(settings))
    servicer = InferenceServicer(engine, control, plane, scope, settings.admin_token,
                                 trust_loopback_admin=settings.trust_loopback_admin)
    grpc_share = IngressGrpc(settings, plan, servicer, scope)
    stop = asyncio.Event()
    background: list[asyncio.Task[None]] = []

    async def startup() -> None:
        tune_garbage_collector()
        await grpc_share.start()
        background.append(asyncio.get_running_loop().create_task(engine.run(stop)))

    async def shutdown() -> None:
        await grpc_share.stopped()  # gRPC calls in flight finish while the engine still serves them
        stop.set()
        for task in background:
            task.cancel()
        for pool in pools:
            pool.shutdown(wait=False)
        await asyncio.to_thread(tracing.shutdown)

    state = AppState(engine, plane, control, settings, metrics, access, knobs, console)
    return create_app(state, startup, shutdown, tracing), plan


def main(argv: list[str]) -> int:
    """Serve until SIGTERM/SIGINT."""
    run_dir, index, fd = Path(argv[1]), int(argv[2]), int(argv[3])
    die_with_parent()
    set_process_title(f"servewell ingress {index}")  # ps and top tell it from the engine and the workers
    settings, _ = read_settings(run_dir)
    configure_logging(settings.log_level, settings.log_format)
    listener = socket.socket(fileno=fd)
    app, plan = build_ingress(settings, run_dir, index)
    options: dict[str, Any] = uvicorn_limit_options(settings, EarlyRefusal.of(app))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=uvicorn_graceful_timeout_s(plan), **options)
    GracefulServer(config, plan).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
