"""`/healthz`'s document, built where the engine runs (the `GetHealth` control operation): the
server's status with its reason, every model's state, readiness, last worker failure, memory,
place in the model pool and traffic split, the pool's summary, the active alerts, rejected
configuration files and the payload log's health. It is open to anyone who can reach the port,
so no absolute file path appears in it (api/public_text.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from servewell.api.engine_parts import EngineParts
from servewell.api.public_text import public_rollout, without_paths
from servewell.api.routes_pool import pool_fields
from servewell.engine.control import HealthReport
from servewell.engine.protocol import SchedulingFacts
from servewell.observability.payload_log import PayloadLog
from servewell.observability.process import rss_bytes


def health_report(parts: EngineParts) -> HealthReport:
    """The document, and whether the server is ready (by its readiness policy)."""
    engine, settings = parts.engine, parts.settings
    models = {}
    roots = (settings.model_repository, settings.cache_dir)  # open to anyone: no absolute paths
    for view in engine.models():
        models[view.name] = {
            "state": view.state,
            "ready": view.state == "ready",
            "version": view.version,
            "reason": without_paths(view.reason, roots),
            "last_failure": without_paths(view.last_failure, roots),
            "serving_dtype": view.serving_dtype,
            "queue_depth": view.queue_depth,
            "load_s": round(view.load_s, 3) if view.load_s is not None else None,
            "restarts": view.restarts,
            "recycles": view.recycles,
            "instances": [asdict(i) for i in view.instances],
            "rss_bytes": sum(i.rss_bytes for i in view.instances),
            "lanes": view.scheduling.lane_depths if view.scheduling else {},
            "max_batch_size": view.scheduling.max_batch_size if view.scheduling else None,
            "scheduler": _scheduler_counts(view.scheduling),
            **pool_fields(view),  # the model pool (engine/model_pool.py): where the model is
            "last_start": view.last_start,  # spawn, import, load, warm-up of its last worker start
            "versions": list(view.versions) or [view.version],
            "rollout": public_rollout(view.rollout, roots),  # full detail: GET /admin/models/{name}/rollout
        }
    readiness = engine.readiness()
    total, reserved = engine.memory_budget
    doc: dict[str, Any] = {
        "status": readiness.status,
        "ready": readiness.ready,
        "readiness": {"policy": engine.readiness_policy, "reason": without_paths(readiness.reason, roots)},
        "frontend_rss_bytes": rss_bytes(),
        "memory_budget": {"total_bytes": total, "reserved_bytes": reserved},
        # The model pool: repository mode, host and device budgets and what loaded models reserve of
        # them, how many models are resident or loading (api/routes_pool.py).
        "pool": engine.pool_report(),
        "models": models,
        # The server's own golden-signal alerts (observability/alerting.py): informative, they never
        # change readiness (a load balancer must not drain a slow server and overload the rest).
        "alerts": parts.console.alerts.to_json(),
    }
    # A rejected config file is degraded configuration, not unreadiness: "ready" stays as it is.
    config = doc["config"] = parts.config_status()
    if config["rejected"] and doc["status"] == "ok":
        doc["status"] = "degraded"
    payload_log = engine.payload_log  # the engine's (observability/payload_log.py)
    if isinstance(payload_log, PayloadLog):  # a failing sink (a full disk) loses records: degraded, still ready
        payload = doc["payload_log"] = payload_log.health()
        if payload["status"] == "failing" and doc["status"] == "ok":
            doc["status"] = "degraded"
    return HealthReport(doc, readiness.ready)


def _scheduler_counts(facts: SchedulingFacts | None) -> dict[str, int] | None:
    if facts is None:
        return None
    return {"batches": facts.batches, "rows": facts.rows, "expired": facts.expired, "cancelled": facts.cancelled,
            "rejected": facts.rejected, "isolated_batches": facts.isolated_batches}
