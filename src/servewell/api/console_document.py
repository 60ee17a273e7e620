"""The console's document (`GET /console/api/state`), built where the engine runs (the
`GetConsoleState` control operation), for the caller's access scope as the ingress's access rule
decided it (api/access.py; the rule for what each caller sees is in api/routes_console.py's
docstring): every ingress process's counters and recent requests are pulled and summed in first.

What each part shows to whom (issue 47 added the last five):
- to anyone the state is open to: the server, the models (each with its `diagnosis`, worker
  replacements with their gaps, its response cache, a generative model's live `streams`), the
  charts, the alerts, and the processes' memory (`memory`: one definition, each process named,
  its series, growth and time to its limit);
- to an operator: the tenants with their admitted / refused / failed counts and their status over
  the last 30 s, refusals by model, lane, tenant and reason (`refusals_by`), who holds each model's
  queue places (`queue_places`), and the audit trail's changes of the chart window (`audit`);
- to a tenant's key: its own tenant's row, refusals and places only (the other tenants' never, not
  even summed); no audit trail.
"""

from __future__ import annotations

import time
from typing import Any

import servewell
from servewell.api.engine_parts import EngineParts
from servewell.api.health_document import (
    cache_fields,
    diagnosis_of,
    frontend_rss_bytes,
    memory_fields,
    replacement_fields,
)
from servewell.api.public_text import public_rollout
from servewell.api.routes_pool import pool_fields
from servewell.engine.control import AccessScope, GetConsoleState
from servewell.engine.engine import InferenceEngine
from servewell.engine.model_entry import ModelEntry
from servewell.engine.protocol import ModelView
from servewell.errors import NotFound, ServeError
from servewell.observability.console_feed import ConsoleFeed, refusals_between, tenants_between
from servewell.observability.latency_reading import latency_split
from servewell.tenancy.policy import tenant_label

#: Changes of the audit trail the console gets (those of the charts' window; at most this many, the latest).
AUDIT_SHOWN = 100


async def console_document(parts: EngineParts, op: GetConsoleState) -> dict[str, Any]:
    """Everything the console shows to `op.scope` (see `routes_console.console_state`)."""
    engine, scope = parts.engine, op.scope
    clients = _recent_clients(engine, scope, op.tenant)  # whose records: None = everyone's (an operator's view)
    sees_records = scope.operator or scope.tenant is not None
    feed = parts.console
    await feed.view.refresh()  # ingress processes' metrics and recent requests (bounded wait)
    total, reserved = engine.views.memory_budget
    readiness = engine.readiness()
    doc: dict[str, Any] = {
        "server": {
            "version": servewell.__version__,
            "ready": readiness.ready,
            "status": readiness.status,  # /healthz's word: ok, degraded, not_ready, shutting_down
            "status_reason": readiness.reason,
            "started_at": feed.started_at,
            "frontend_rss_bytes": frontend_rss_bytes(feed),  # the engine and every ingress process (as /healthz)
            "memory_budget": {"total_bytes": total, "reserved_bytes": reserved},
            "pool": engine.views.pool_report(),  # repository mode, budgets, resident and loading counts
            "keys_required": parts.access.enabled,
            "max_body_bytes": parts.settings.max_body_bytes,
            "slow_request_ms": round(parts.knobs.slow_request_s * 1000, 3),
            "admin": scope.operator,
            "admin_reason": scope.denial,
            "tenant": scope.tenant,  # a tenant's key: the tenant whose part the records and tenants show
        },
        "models": [_model(view, engine if scope.operator else None, feed) for view in engine.views.models()],
        "series": {**feed.series(op.model), "models": feed.models()},
        "recent": feed.recent.to_json(op.recent, clients) if sees_records else None,
        "tenants": _tenants_report(engine, scope),
        "recent_recorded": feed.recent.recorded if scope.operator else None,  # the whole server's count
        "config": parts.config_status(),  # rejected config files (live_config.py), shown as a banner
        "alerts": feed.alerts.to_json(),
        "alerts_evaluated_at": feed.alerts.evaluated_at,
        "memory": {**memory_fields(feed), **_memory_series(feed)},
        "audit": feed.audit.to_json(since=time.time() - feed.window_s, limit=AUDIT_SHOWN) if scope.operator else None,
    }
    # Each model's compute time by batch size (aggregates, like /metrics), then its golden signals and
    # p99 split (which read it). `recent` records carry batch_id, batch_size, instance, queue_position;
    # refusals (401/403/429, 4xx naming no model: `observability/recent_requests.py`) are kept apart.
    for entry in doc["models"]:
        entry["compute_by_batch_size"] = feed.compute_by_batch_size(entry["name"])
        _add_golden_signals(entry, feed)
        entry["cache"] = cache_fields(engine, feed, entry["name"])  # as /healthz shows it
        entry["streams"] = _streams(engine, entry["name"])
    doc["refusals"] = feed.recent.refusals_json(op.recent, clients) if sees_records else None
    own = None if scope.operator else tenant_label(scope.tenant) if scope.tenant is not None else None
    if scope.operator or own is not None:
        doc["refusals_by"] = _refusals_by(feed, own)
        doc["queue_places"] = _queue_places(engine, own)
        _add_tenant_windows(doc["tenants"] or [], feed)
    else:
        doc["refusals_by"] = doc["queue_places"] = None
    return doc


def _memory_series(feed: ConsoleFeed) -> dict[str, Any]:
    series = feed.memory.to_json()
    return {"interval_s": series["interval_s"], "window_s": series["window_s"], "series": series["series"]}


def _streams(engine: InferenceEngine, name: str) -> dict[str, Any] | None:
    """A generative model's live streams (issue 48): sequences running and waiting now, their place
    bound, and since it loaded the sequences started, the parts sent and how each ended (None for a
    model that is not generative or not resident). Counts only, no request of anyone's: shown to
    whoever sees the models, as the queue depth is."""
    slot = engine.registry.slots.get(name)
    entry = slot.entry if slot is not None else None
    sequences = entry.sequences if isinstance(entry, ModelEntry) else None
    if sequences is None:
        return None
    stats = sequences.stats()
    return {"running": stats.running, "waiting": stats.waiting, "max_sequences": sequences.settings.max_sequences,
            "batching": sequences.settings.batching, "started": stats.started, "parts": stats.parts,
            "steps": stats.steps, "ended": {"finished": stats.finished, "cancelled": stats.cancelled,
                                             "deadline_exceeded": stats.expired, "stream_too_slow": stats.too_slow,
                                             "failed": stats.failed}}


def _refusals_by(feed: ConsoleFeed, own: str | None) -> list[dict[str, Any]]:
    """Refusals by model, lane, tenant and reason: over the last 30 s and since the server started
    (every process's, summed); `own`: one tenant's only."""
    window = feed.window()
    recent = refusals_between(window[1], window[2]) if window is not None else {}
    metrics = feed.metrics
    totals = dict(metrics.refusals.snapshot()) if metrics is not None else {}
    rows = []
    for labels, total in totals.items():
        model, lane, tenant, reason = key = (labels[0], labels[1], labels[2], labels[3])
        if own is not None and tenant != own:
            continue
        rows.append({"model": model, "lane": lane, "tenant": tenant, "reason": reason,
                     "last_30s": round(recent.get(key, 0.0)), "total": round(total)})
    return sorted(rows, key=lambda r: (-r["last_30s"], -r["total"], r["model"], r["tenant"]))


def _queue_places(engine: InferenceEngine, own: str | None) -> dict[str, dict[str, dict[str, int]]]:
    """Who holds each model's queue places now: model -> lane -> tenant -> queued requests (lanes with
    requests only); `own`: that tenant's places only."""
    found: dict[str, dict[str, dict[str, int]]] = {}
    for name, slot in list(engine.registry.slots.items()):
        entry = slot.entry
        if not isinstance(entry, ModelEntry):
            continue
        scheduler = entry.scheduler
        depths = scheduler.lane_depths()
        for index, lane in enumerate(scheduler.lanes):
            if not depths.get(lane):
                continue
            places = {tenant_label(t): n for t, n in scheduler.lane_places(index).items()}
            if own is not None:
                places = {t: n for t, n in places.items() if t == own}
            if places:
                found.setdefault(name, {})[lane] = places
    return found


def _add_tenant_windows(rows: list[dict[str, Any]], feed: ConsoleFeed) -> None:
    """Each tenant's row gets its requests over the last 30 s (admitted, refused, failed; a quota's
    refusals count as refused) and a status that never says ok while its requests fail: ok,
    refused (some were refused: 429 or 503) or failing (some failed with an error)."""
    window = feed.window()
    recent = tenants_between(window[1], window[2]) if window is not None else {}
    for row in rows:
        counts = recent.get(row["tenant"], {})
        quota = sum(counts.get(k, 0.0) for k in ("over_rate", "over_concurrency", "over_queue"))
        last = {"admitted": round(counts.get("admitted", 0.0)), "refused": round(counts.get("refused", 0.0) + quota),
                "failed": round(counts.get("failed", 0.0)), "window_s": round(window[0], 1) if window else None}
        row["last_30s"] = last
        row["status"] = "failing" if last["failed"] else "refused" if last["refused"] else "ok"


def _model(view: ModelView, admin_engine: InferenceEngine | None, feed: ConsoleFeed) -> dict[str, Any]:
    config, facts = view.config, view.scheduling
    doc: dict[str, Any] = {
        "name": view.name,
        "version": view.version,
        "state": view.state,
        "reason": view.reason,
        "load_s": round(view.load_s, 3) if view.load_s is not None else None,
        **replacement_fields(feed, view),  # every cause counted as restarts, the gaps listed (as /healthz)
        "diagnosis": diagnosis_of(feed, view.name),
        "instances": [{"instance": i.instance, "pid": i.pid, "alive": i.alive, "rss_bytes": i.rss_bytes,
                       "rows_computed": i.rows_computed} for i in view.instances],
        "lanes": dict(facts.lane_depths) if facts else {},
        "queue_depth": view.queue_depth,
        "running_rows": facts.running_rows if facts else 0,
        "max_batch_size": facts.max_batch_size if facts else None,
        "configured_max_batch_size": config.max_batch_size if config else None,
        "scheduler": ({"batches": facts.batches, "rows": facts.rows, "expired": facts.expired,
                       "cancelled": facts.cancelled, "rejected": facts.rejected} if facts else None),
        "takes_images": bool(config and config.preprocess is not None and config.image_input is not None),
        "runtime": config.runtime if config else None,
        **pool_fields(view),  # residency, loadable, pinned, last_used_at, estimated_bytes, cold_starts, evictions
        "rollout": public_rollout(view.rollout, ()),  # the console shows reasons as they are
    }
    if admin_engine is not None and config is not None:
        try:
            doc["batching"] = admin_engine.admin.batching(view.name)
        except ServeError:
            doc["batching"] = None  # unloaded or being replaced right now
    return doc


def _add_golden_signals(entry: dict[str, Any], feed: ConsoleFeed) -> None:
    # The models table's per-model req/s, latency and error ratio, and the split of its p99 (uses
    # the model's compute_by_batch_size when the entry carries one).
    summary = feed.summary(entry["name"])
    entry["signals"] = summary
    entry["latency_split"] = latency_split(summary, entry.get("compute_by_batch_size")).to_json()


def _recent_clients(engine: InferenceEngine, scope: AccessScope, tenant: str | None) -> frozenset[str] | None:
    """The key ids whose records `scope` is shown (None: every record). An operator: all, or
    `tenant`'s (404 for a tenant the keys in force do not name). A tenant's key: its own tenant's
    (the ingress refused `tenant` naming any other: api/routes_console.py)."""
    own = scope.tenant
    tenants = engine.tenants
    if own is None:
        if not scope.operator or tenant is None:
            return None
        keys = tenants.keys_of(tenant) if tenants is not None else frozenset()
        if not keys:
            raise NotFound("unknown tenant; use one of the keys file's tenants, or - for requests without a key")
        return keys
    keys = tenants.keys_of(own) if tenants is not None else frozenset()
    return keys or frozenset((scope.key_id,) if scope.key_id is not None else ())


def _tenants_report(engine: InferenceEngine, scope: AccessScope) -> list[dict[str, Any]] | None:
    """Every tenant's row for an operator, the caller's own tenant's row for a tenant's key, None otherwise."""
    tenants = engine.tenants
    if tenants is None or not (scope.operator or scope.tenant is not None):
        return None
    report = tenants.report()
    if scope.operator:
        return report
    own = tenant_label(scope.tenant or "")
    return [row for row in report if row["tenant"] == own]
