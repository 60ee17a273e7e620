"""The engine's answer to every control operation (engine/control.py): the one table from an
operation's type to its handler, built once where the engine runs (server.py) and called by the
door for an ingress's `ControlCall`, or directly by the single-process server's routes
(api/control_plane.py). A handler raises the `ServeError` the caller gets, as it would in-process.

Every change an operation applies is written to the audit trail (observability/audit.py) with the
operation's `actor`, the values before and after: only once it applied (a refused change is not one).
"""

from __future__ import annotations

import asyncio
from typing import Any

from servewell.allocator import give_back_freed_memory
from servewell.api.console_document import console_document
from servewell.api.engine_parts import EngineParts
from servewell.api.health_document import health_report
from servewell.engine.control import (
    CheckLive,
    ClearCache,
    ControlDispatch,
    DescribeModel,
    EvictModel,
    GetAudit,
    GetBatching,
    GetCache,
    GetConfigReport,
    GetConsoleState,
    GetHealth,
    GetMetricsText,
    GetReadiness,
    GetRollout,
    HealthReport,
    ListModels,
    ListTenants,
    LoadModel,
    PinModel,
    PreloadModel,
    ProfileModel,
    UnloadModel,
    UnpinModel,
    UpdateBatching,
    UpdateCache,
    UpdateRollout,
    UpdateTenant,
)
from servewell.engine.protocol import ModelView, Readiness
from servewell.engine.response_cache import ResponseCache
from servewell.engine.tenants import Tenants
from servewell.errors import Conflict, NotFound, ServeError
from servewell.observability.audit import actor_name
from servewell.observability.exposition import render_text

#: How the admin API is named in the audit trail.
VIA_ADMIN = "admin API"


def control_table(parts: EngineParts) -> ControlDispatch:
    """The dispatch table of `parts.engine` (raises `ValueError` if an operation has no handler)."""
    engine = parts.engine
    audit = parts.console.audit

    def who(actor: str) -> str:
        return actor or actor_name(None)

    def model_state(view: ModelView) -> dict[str, Any]:
        return {"version": view.version, "state": view.state, "pinned": view.pinned, "residency": view.residency}

    def record_view(actor: str, what: str, before: ModelView | None, after: ModelView) -> None:
        old = model_state(before) if before is not None else None
        audit.record(who(actor), VIA_ADMIN, what, after.name, old, model_state(after),
                     f"{what} of {after.name}: version {after.version}, {after.state}")

    def view_or_none(name: str) -> ModelView | None:
        try:
            return engine.views.model(name)
        except ServeError:
            return None

    # --- models and the repository -------------------------------------------------------------

    async def list_models(op: ListModels) -> list[ModelView]:
        return engine.views.models()

    async def describe_model(op: DescribeModel) -> ModelView:
        return engine.views.model(op.name, op.version)

    async def load_model(op: LoadModel) -> ModelView:
        before = view_or_none(op.name)
        view: ModelView = await engine.loader.load_model(op.name)
        record_view(op.actor, "model loaded", before, view)
        return view

    async def unload_model(op: UnloadModel) -> ModelView:
        before = view_or_none(op.name)
        view: ModelView = await engine.loader.unload_model(op.name)
        record_view(op.actor, "model unloaded", before, view)
        return view

    # --- the model pool (engine/admin_ops.py, engine/model_loader.py) -----------------------------------

    async def pin(op: PinModel) -> ModelView:
        before = view_or_none(op.name)
        view: ModelView = await engine.admin.pin(op.name)
        record_view(op.actor, "pinned", before, view)
        return view

    async def unpin(op: UnpinModel) -> ModelView:
        before = view_or_none(op.name)
        view: ModelView = await engine.admin.unpin(op.name)
        record_view(op.actor, "unpinned", before, view)
        return view

    async def preload(op: PreloadModel) -> ModelView:
        before = view_or_none(op.name)
        view: ModelView = await engine.loader.preload(op.name)
        record_view(op.actor, "preloaded", before, view)
        return view

    async def evict(op: EvictModel) -> ModelView:
        before = view_or_none(op.name)
        view: ModelView = await engine.loader.evict(op.name)
        record_view(op.actor, "evicted", before, view)
        return view

    # --- batching, traffic splits, response caches ---------------------------------------------

    async def get_batching(op: GetBatching) -> dict[str, Any]:
        return engine.admin.batching(op.name)

    async def update_batching(op: UpdateBatching) -> dict[str, Any]:
        before = engine.admin.batching(op.name)
        settings: dict[str, Any] = engine.admin.update_batching(op.name, op.changes)
        audit.record_fields(who(op.actor), VIA_ADMIN, "batching", op.name, before, settings)
        return settings

    async def get_rollout(op: GetRollout) -> dict[str, Any]:
        return engine.admin.rollout(op.name)

    async def update_rollout(op: UpdateRollout) -> dict[str, Any]:
        before = _traffic(engine.admin.rollout(op.name))
        rollout: dict[str, Any] = engine.admin.update_rollout(op.name, op.patch)
        audit.record_fields(who(op.actor), VIA_ADMIN, "traffic", op.name, before, _traffic(rollout))
        return rollout

    async def get_cache(op: GetCache) -> dict[str, Any]:
        cache = engine.admin.response_cache(op.name)
        return {"model": op.name, "cache": cache.report() if cache is not None else None}

    async def update_cache(op: UpdateCache) -> dict[str, Any]:
        cache = _cache(op.name)
        before = {"max_bytes": cache.max_bytes, "ttl_s": cache.ttl_s}
        changes = op.changes  # a field given as None goes back to model.yaml's value
        if "max_bytes" in changes:
            max_bytes = changes["max_bytes"]
            cache.resize(max_bytes=cache.config.max_bytes if max_bytes is None else int(max_bytes))
        if "ttl_s" in changes:
            ttl_s = changes["ttl_s"]
            cache.resize(ttl_s=cache.config.ttl_s if ttl_s is None else float(ttl_s))
        audit.record_fields(who(op.actor), VIA_ADMIN, "cache", op.name, before,
                            {"max_bytes": cache.max_bytes, "ttl_s": cache.ttl_s})
        return {"model": op.name, "cache": cache.report()}

    async def clear_cache(op: ClearCache) -> dict[str, Any]:
        cache = _cache(op.name)
        dropped = cache.clear()
        audit.record(who(op.actor), VIA_ADMIN, "cache", op.name, {"entries": dropped}, {"entries": 0},
                     f"cache of {op.name} cleared ({dropped} answers dropped)")
        # Small answers freed in bulk stay in the C heap, resident, until reused (hostile case
        # cache_memory: none of 12 MB came back); a trim returns their pages. Off the loop: it walks the heap.
        await asyncio.to_thread(give_back_freed_memory)
        return {"model": op.name, "dropped": dropped, "cache": cache.report()}

    def _cache(name: str) -> ResponseCache:
        cache = engine.admin.response_cache(name)
        if cache is None:
            raise Conflict(f"model {name!r} has no response cache (no cache: in its model.yaml)")
        return cache

    # --- tenants ---------------------------------------------------------------------------------

    async def list_tenants(op: ListTenants) -> list[dict[str, Any]]:
        return _tenants().report()

    async def update_tenant(op: UpdateTenant) -> dict[str, Any]:
        tenants = _tenants()
        quotas = ("weight", "rate_per_s", "max_concurrent", "max_queued")
        before = next(({k: row[k] for k in quotas} for row in tenants.report() if row["tenant"] == op.tenant), {})
        row = tenants.update(op.tenant, dict(op.changes))
        audit.record_fields(who(op.actor), VIA_ADMIN, "tenant", op.tenant, before, {k: row[k] for k in quotas})
        return row

    def _tenants() -> Tenants:
        if engine.tenants is None:
            raise ServeError("this engine keeps no tenants")
        return engine.tenants

    # --- profiling and the server's views ------------------------------------------------------

    async def profile(op: ProfileModel) -> bytes:
        return await engine.admin.profile(op.name, op.instance, op.seconds)

    async def live(op: CheckLive) -> bool:
        return True

    async def readiness(op: GetReadiness) -> Readiness:
        return engine.readiness()

    async def health(op: GetHealth) -> HealthReport:
        return health_report(parts)

    async def config_report(op: GetConfigReport) -> dict[str, Any]:
        return parts.config_report()

    async def metrics_text(op: GetMetricsText) -> bytes:
        if parts.metrics is None:
            raise NotFound("metrics are turned off on this server (--metrics-enabled false)")
        await parts.console.view.refresh()  # ingress processes' series, summed in (bounded wait)
        # in slices, the loop served between them (35,000 lines with 200 models: observability/exposition.py)
        return await render_text(parts.metrics.registry)

    async def console_state(op: GetConsoleState) -> dict[str, Any]:
        return await console_document(parts, op)

    async def audit_trail(op: GetAudit) -> list[dict[str, Any]]:
        return audit.to_json(op.since, op.limit, op.target)

    return ControlDispatch({
        ListModels: list_models, DescribeModel: describe_model, LoadModel: load_model, UnloadModel: unload_model,
        PinModel: pin, UnpinModel: unpin, PreloadModel: preload, EvictModel: evict,
        GetBatching: get_batching, UpdateBatching: update_batching, GetRollout: get_rollout,
        UpdateRollout: update_rollout, GetCache: get_cache, UpdateCache: update_cache, ClearCache: clear_cache,
        ListTenants: list_tenants, UpdateTenant: update_tenant, ProfileModel: profile, CheckLive: live,
        GetReadiness: readiness, GetHealth: health, GetConfigReport: config_report, GetMetricsText: metrics_text,
        GetConsoleState: console_state, GetAudit: audit_trail,
    })


def _traffic(rollout: dict[str, Any]) -> dict[str, Any]:
    """What an admin changes of a traffic split: the weights and the shadow's share."""
    shadow = rollout.get("shadow")
    return {"weights": rollout.get("weights"), "shadow_percent": shadow.get("percent") if shadow else None}
