"""What the HTTP routes share, kept on the app: the engine's data plane, its control plane and the settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from servewell.api.control_plane import ControlPlane
from servewell.api.dataplane import DataPlane
from servewell.api.keys import InferenceAccess
from servewell.config.server import ServerConfig
from servewell.engine.protocol import ServingEngine
from servewell.observability.console_feed import ConsoleFeed
from servewell.observability.metrics import ServeMetrics


@dataclass(slots=True)
class LiveKnobs:
    """Settings a config reload changes while serving; read per request."""

    slow_request_s: float
    metrics_need_key: bool


@dataclass(slots=True, frozen=True)
class AppState:
    """Everything a route may use."""

    engine: ServingEngine
    plane: DataPlane
    #: Every admin, repository, metadata and view operation (engine/control.py) goes here.
    control: ControlPlane
    settings: ServerConfig
    metrics: ServeMetrics | None
    access: InferenceAccess
    knobs: LiveKnobs
    #: This process's recent slow/failed requests (the middleware fills it) and, where the engine
    #: runs, the console's chart series and every ingress's share (observability/view_sources.py).
    console: ConsoleFeed = field(default_factory=ConsoleFeed)


def app_state(request: Request) -> AppState:
    """The shared state (the hot routes call this directly, which costs less than dependency solving)."""
    state: AppState = request.app.state.servewell
    return state


async def state_dependency(request: Request) -> AppState:
    """`app_state` as a FastAPI dependency. Async on purpose: FastAPI runs a plain-function
    dependency in its thread pool, a thread hop per request (health probes, metadata and /metrics
    each paid about 0.2 ms of frontend CPU for it)."""
    return app_state(request)
