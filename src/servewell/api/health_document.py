"""`/healthz`'s document, built where the engine runs (the `GetHealth` control operation): the
server's status with its reason, every model's state, readiness, last worker failure, memory,
place in the model pool and traffic split, the pool's summary, the active alerts, rejected
configuration files and the payload log's health. It is open to anyone who can reach the port,
so no absolute file path appears in it (api/public_text.py).

Beside those (issue 47), each model's `diagnosis` (the console's reading, observability/diagnosis.py),
its worker replacements counted the one way the metric counts them (`restarts` is every
replacement, `restarts_by_reason` by crash, hung and memory; `recycles` is the memory part, kept for
old readers), the latest replacements with the gap each caused, its response cache (`cache`: live
entries and bytes, lookups and hit ratio, repeats against the TTL), and the server's processes'
memory under one definition (`memory`: RSS per process, named engine, ingress N, worker MODEL vV
#I). The builders here are shared with the console's document, so both say the same.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from servewell.api.engine_parts import EngineParts
from servewell.api.public_text import public_rollout, without_paths
from servewell.api.routes_pool import pool_fields
from servewell.engine.control import HealthReport
from servewell.engine.engine import InferenceEngine
from servewell.engine.protocol import ModelView, SchedulingFacts
from servewell.errors import ServeError
from servewell.observability.console_feed import ConsoleFeed, cache_between
from servewell.observability.memory_series import DEFINITION
from servewell.observability.payload_log import PayloadLog
from servewell.observability.process import rss_bytes

#: Replacements listed per model: those of the last five minutes (the console's window).
REPLACEMENTS_SHOWN_S = 300.0


def health_report(parts: EngineParts) -> HealthReport:
    """The document, and whether the server is ready (by its readiness policy)."""
    engine, settings = parts.engine, parts.settings
    models = {}
    roots = (settings.model_repository, settings.cache_dir)  # open to anyone: no absolute paths
    for view in engine.views.models():
        models[view.name] = {
            "state": view.state,
            "ready": view.state == "ready",
            "version": view.version,
            "reason": without_paths(view.reason, roots),
            "last_failure": without_paths(view.last_failure, roots),
            "serving_dtype": view.serving_dtype,
            "queue_depth": view.queue_depth,
            "load_s": round(view.load_s, 3) if view.load_s is not None else None,
            **replacement_fields(parts.console, view),  # restarts, restarts_by_reason, recycles, replacements
            "instances": [asdict(i) for i in view.instances],
            "rss_bytes": sum(i.rss_bytes for i in view.instances),
            "lanes": view.scheduling.lane_depths if view.scheduling else {},
            "max_batch_size": view.scheduling.max_batch_size if view.scheduling else None,
            "scheduler": _scheduler_counts(view.scheduling),
            **pool_fields(view),  # the model pool (engine/model_pool.py): where the model is
            "last_start": view.last_start,  # spawn, import, load, warm-up of its last worker start
            "versions": list(view.versions) or [view.version],
            "rollout": public_rollout(view.rollout, roots),  # full detail: GET /admin/models/{name}/rollout
            "cache": cache_fields(engine, parts.console, view.name),
            "diagnosis": diagnosis_of(parts.console, view.name),
        }
    readiness = engine.readiness()
    total, reserved = engine.views.memory_budget
    doc: dict[str, Any] = {
        "status": readiness.status,
        "ready": readiness.ready,
        "readiness": {"policy": engine.gate.policy, "reason": without_paths(readiness.reason, roots)},
        "frontend_rss_bytes": frontend_rss_bytes(parts.console),  # the engine and every ingress process
        "memory": memory_fields(parts.console),
        "memory_budget": {"total_bytes": total, "reserved_bytes": reserved},
        # The model pool: repository mode, host and device budgets and what loaded models reserve of
        # them, how many models are resident or loading (api/routes_pool.py).
        "pool": engine.views.pool_report(),
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


def replacement_fields(feed: ConsoleFeed, view: ModelView) -> dict[str, Any]:
    """A model's worker replacements as `servewell_worker_restarts_total` counts them (since the server
    started, every cause), and the latest with their gaps (observability/worker_events.py)."""
    by_reason = feed.worker_events.counts(view.name)
    return {"restarts": sum(by_reason.values()), "restarts_by_reason": by_reason, "recycles": by_reason["memory"],
            "replacements": feed.worker_events.to_json(view.name, REPLACEMENTS_SHOWN_S)}


def diagnosis_of(feed: ConsoleFeed, model: str) -> dict[str, Any] | None:
    """The model's latest diagnosis (None before the first tick, or for a model without a scheduler)."""
    found = feed.diagnoses.get(model)
    return found.to_json() if found is not None else None


def cache_fields(engine: InferenceEngine, feed: ConsoleFeed, model: str) -> dict[str, Any] | None:
    """The response cache of the version serving `model` (None: it has none): settings, live entries
    and bytes (answers past the TTL are dropped before they are counted: `expired` says how many were),
    counts since it was built, and over the console's last 30 s: lookups, hit ratio, repeats within and
    beyond the TTL and the reuse-interval histogram."""
    try:
        cache = engine.admin.response_cache(model)
    except ServeError:
        return None
    if cache is None:
        return None
    report = cache.report()
    lookups = report["hit"] + report["coalesced"] + report["miss"]
    doc: dict[str, Any] = {
        "ttl_s": report["ttl_s"], "max_bytes": report["max_bytes"],
        "shared_across_tenants": report["shared_across_tenants"],
        "entries": report["entries"], "bytes": report["bytes"], "in_flight": report["in_flight"],
        "expired": report["evicted_ttl"], "evicted": {"size": report["evicted_size"], "ttl": report["evicted_ttl"]},
        "hits": report["hit"], "coalesced": report["coalesced"], "misses": report["miss"],
        "hit_ratio": round(report["hit"] / lookups, 4) if lookups else None,
        "reused_within_ttl": report["reused_within_ttl"], "reused_beyond_ttl": report["reused_beyond_ttl"],
        "window": None,
    }
    window = feed.window()
    if window is not None:
        elapsed_s, before, after = window
        recent = cache_between(before, after, model)
        seen = recent["hit"] + recent["coalesced"] + recent["miss"]
        recent["window_s"] = round(elapsed_s, 3)
        recent["hit_ratio"] = round(recent["hit"] / seen, 4) if seen else None
        doc["window"] = recent
    return doc


def frontend_rss_bytes(feed: ConsoleFeed) -> int:
    """The server's own processes' resident memory: the engine and every ingress process (the same
    figure in /healthz and the console; `memory.processes` has each apart)."""
    return rss_bytes() + feed.view.absorbed_rss_bytes()


def memory_fields(feed: ConsoleFeed) -> dict[str, Any]:
    """Every memory figure of the server, one definition (`DEFINITION`), named by process: totals by
    role (the engine's now, the others' as last sampled) and each process with its growth and time
    to its limit (the console's series, sampled every 2 s)."""
    processes = feed.memory.latest()
    workers = sum(row["rss_bytes"] for row in processes if row["role"] == "worker")
    return {"definition": DEFINITION, "engine_rss_bytes": rss_bytes(),
            "ingress_rss_bytes": feed.view.absorbed_rss_bytes(), "workers_rss_bytes": workers,
            "processes": processes}
