"""What the engine's control handlers read (api/control_handlers.py): the engine and the parts of
the server beside it, in the process that runs the engine (the single-process server, or a split
server's engine process)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.config.server import ServerConfig
from servewell.engine.engine import InferenceEngine
from servewell.observability.console_feed import ConsoleFeed
from servewell.observability.metrics import ServeMetrics


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The engine, its settings and live knobs, the keys in force, and the one view of the server."""

    engine: InferenceEngine
    settings: ServerConfig
    access: InferenceAccess
    knobs: LiveKnobs
    #: The console's chart series, recent requests and alerts, every ingress's share absorbed.
    console: ConsoleFeed
    metrics: ServeMetrics | None
    #: The active configuration for `GET /admin/config` (live_config.py `ConfigReloader.report`).
    config_report: Callable[[], dict[str, Any]]
    #: Rejected configuration files: `{"status": "ok" | "degraded", "rejected": [...]}` (live_config.py).
    config_status: Callable[[], dict[str, Any]]
