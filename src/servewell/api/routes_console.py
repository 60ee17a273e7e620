"""The live console: the page at `/`, its static assets, and the JSON it polls.

Access follows the server's one rule (api/access.py; the README's "Console" section):
- the page and its assets hold no data and are open, like the docs;
- `GET /console/api/state` answers an operator (the admin token, an operator key, or a trusted
  loopback client) without more, and anyone else only with an API key when keys are configured,
  like `/predict`; it shows what `/healthz` shows (model states, instances, queues, the charts);
- the per-request records (recent slow and failed requests and refusals: request ids, key ids,
  error codes), the tenants' weights, quotas and counts, and the batching settings follow the
  rule: an operator sees the whole server's (and may filter the records by `?tenant=`); a
  tenant's key sees its own tenant's records and its own tenant's row only (`?tenant=` of another
  tenant: 403, whether it exists or not), never another tenant's nor another's key ids; anyone
  else sees none. Withheld parts are null and `server.admin_reason` says why, rather than the
  whole document being refused.
"""

from __future__ import annotations

import functools
import hashlib
import re
from importlib import resources
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

import servewell
from servewell.api.access import Caller
from servewell.api.openapi import error_responses
from servewell.api.public_text import public_rollout
from servewell.api.routes_admin import caller_of
from servewell.api.routes_pool import pool_fields, pool_report
from servewell.api.state import AppState, app_state
from servewell.engine.protocol import ModelView
from servewell.engine.tenants import Tenants, tenant_label
from servewell.errors import Forbidden, NotFound, ServeError
from servewell.observability.console_feed import ALL_MODELS, ConsoleFeed
from servewell.observability.latency_reading import latency_split
from servewell.observability.process import rss_bytes

router = APIRouter(tags=["console"])

#: The files the page may load, and their media types: nothing else under the package is served.
ASSETS = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
#: The page runs only its own files: no inline script, no other origin.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_ASSET_REF = re.compile(r"\{\{asset:([A-Za-z0-9_.-]+)\}\}")
_RECENT_LIMIT = 200


@functools.cache
def asset(name: str) -> bytes:
    """The bytes of a packaged console file (read once)."""
    return resources.files("servewell.api").joinpath("console", name).read_bytes()


@functools.cache
def _page_template() -> str:
    """index.html with every asset reference turned into a URL carrying the file's hash, so a
    browser may cache assets for a day and still gets new ones after an upgrade."""
    def url(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in ASSETS:
            raise KeyError(f"index.html refers to unknown asset {name}")
        return f"/console/assets/{name}?v={hashlib.sha256(asset(name)).hexdigest()[:12]}"

    return _ASSET_REF.sub(url, asset("index.html").decode())


@router.get("/", include_in_schema=False)
async def console_page(request: Request) -> Response:
    """The console page (open: it holds no data, the JSON it polls follows the key rule)."""
    keys = "true" if app_state(request).access.enabled else "false"
    body = _page_template().replace("{{keys_required}}", keys)
    return Response(body, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


@router.get("/console/assets/{name}", include_in_schema=False)
async def console_asset(name: str) -> Response:
    """One of the page's packaged files (`ASSETS`); 404 for any other name."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound("no such console asset")
    return Response(asset(name), media_type=media_type,
                    headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})


@router.get("/console/api/state", summary="Everything the console shows",
            responses=error_responses(401, 403, 404, 422, 429))
async def console_state(
    request: Request,
    model: str = Query(ALL_MODELS, max_length=200, description="Whose chart series: a model name, or * for all."),
    recent: int = Query(50, ge=0, le=_RECENT_LIMIT, description="How many recent slow/failed requests."),
    tenant: str | None = Query(None, max_length=64, description="Only this tenant's recent requests (a tenant of "
                               "the keys file, or - for requests without a key); a tenant's key: its own only."),
) -> Response:
    """Server facts (with `/healthz`'s status and reason), every model (state, reason, instances
    and their memory, queue per lane, effective max batch size, its `rollout` (state, weights and the
    reason of a rollback) when it splits traffic between versions, `signals` over the last 30 s and
    `latency_split` of its p99 with a reading, its place in the model pool: residency, pinned, last
    use, estimated memory), the pool's summary, the server's active alerts, the chart series of
    `model` over the last minutes; for an operator, the recent slow and failed requests and refusals,
    each model's batching settings and the tenants (weights, quotas, in progress, refusals by
    reason; `tenant` filters the recent requests to one); for a tenant's key, its own tenant's
    recent requests, refusals and row (`tenant` of another: 403). Needs an API key when keys are
    configured, unless the caller is an operator (api/access.py)."""
    state = app_state(request)
    if model != ALL_MODELS and not state.engine.knows(model):
        raise NotFound("unknown model; use * or one of this server's models")
    caller = caller_of(request, state)
    admin = caller.operator
    admin_reason = caller.denial.message if caller.denial is not None else None
    clients = _recent_clients(state, caller, tenant)  # whose records: None = everyone's (an operator's view)
    sees_records = admin or caller.tenant is not None
    feed = state.console
    await feed.view.refresh()  # ingress processes' metrics and recent requests (bounded wait)
    total, reserved = state.engine.memory_budget
    readiness = state.engine.readiness()
    doc: dict[str, Any] = {
        "server": {
            "version": servewell.__version__,
            "ready": readiness.ready,
            "status": readiness.status,  # /healthz's word: ok, degraded, not_ready, shutting_down
            "status_reason": readiness.reason,
            "started_at": feed.started_at,
            "frontend_rss_bytes": rss_bytes() + feed.view.absorbed_rss_bytes(),  # with ingress processes
            "memory_budget": {"total_bytes": total, "reserved_bytes": reserved},
            "pool": pool_report(state.engine),  # repository mode, budgets, resident and loading counts
            "keys_required": state.access.enabled,
            "max_body_bytes": state.settings.max_body_bytes,
            "slow_request_ms": round(state.knobs.slow_request_s * 1000, 3),
            "admin": admin,
            "admin_reason": admin_reason,
            "tenant": caller.tenant,  # a tenant's key: the tenant whose part the records and tenants show
        },
        "models": [_model(view, state if admin else None) for view in state.engine.models()],
        "series": {**feed.series(model), "models": feed.models()},
        "recent": feed.recent.to_json(recent, clients) if sees_records else None,
        "tenants": _tenants_report(state, caller),
        "recent_recorded": feed.recent.recorded if admin else None,  # the whole server's count
        "config": state.config_status(),  # rejected config files (live_config.py), shown as a banner
        "alerts": feed.alerts.to_json(),
        "alerts_evaluated_at": feed.alerts.evaluated_at,
    }
    # Each model's compute time by batch size (aggregates, like /metrics), then its golden signals and
    # p99 split (which read it). `recent` records carry batch_id, batch_size, instance, queue_position;
    # refusals (401/403/429, 4xx naming no model: `observability/recent_requests.py`) are kept apart.
    for entry in doc["models"]:
        entry["compute_by_batch_size"] = feed.compute_by_batch_size(entry["name"])
        _add_golden_signals(entry, feed)
    doc["refusals"] = feed.recent.refusals_json(recent, clients) if sees_records else None
    return Response(orjson.dumps(doc), media_type="application/json", headers={"Cache-Control": "no-store"})


def _model(view: ModelView, admin_state: AppState | None) -> dict[str, Any]:
    config, facts = view.config, view.scheduling
    doc: dict[str, Any] = {
        "name": view.name,
        "version": view.version,
        "state": view.state,
        "reason": view.reason,
        "load_s": round(view.load_s, 3) if view.load_s is not None else None,
        "restarts": view.restarts,
        "recycles": view.recycles,
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
    if admin_state is not None and config is not None:
        try:
            doc["batching"] = admin_state.engine.batching(view.name)
        except ServeError:
            doc["batching"] = None  # unloaded or being replaced right now
    return doc


def _add_golden_signals(entry: dict[str, Any], feed: ConsoleFeed) -> None:
    # The models table's per-model req/s, latency and error ratio, and the split of its p99 (uses
    # the model's compute_by_batch_size when the entry carries one).
    summary = feed.summary(entry["name"])
    entry["signals"] = summary
    entry["latency_split"] = latency_split(summary, entry.get("compute_by_batch_size")).to_json()


def _tenants(state: AppState) -> Tenants | None:
    tenants = getattr(state.engine, "tenants", None)
    return tenants if isinstance(tenants, Tenants) else None


def _recent_clients(state: AppState, caller: Caller, tenant: str | None) -> frozenset[str] | None:
    """The key ids whose records `caller` is shown (None: every record). An operator: all, or
    `tenant`'s (404 for a tenant the keys in force do not name). A tenant's key: its own tenant's,
    and 403 for `tenant` naming any other, known or not (a 404 would tell which tenants exist)."""
    own = caller.tenant
    if own is None:
        return _tenant_keys(state, tenant) if caller.operator else None
    if tenant is not None and tenant != own:
        raise Forbidden(f"this API key belongs to tenant '{own}', which sees its own requests only: another "
                        "tenant's need the admin token or an operator key (role=operator)")
    tenants = _tenants(state)
    keys = tenants.keys_of(own) if tenants is not None else frozenset()
    return keys or frozenset((caller.key.id,) if caller.key is not None else ())


def _tenant_keys(state: AppState, tenant: str | None) -> frozenset[str] | None:
    """The key ids of `tenant` (None: no filter); 404 for a tenant the keys in force do not name."""
    if tenant is None:
        return None
    tenants = _tenants(state)
    keys = tenants.keys_of(tenant) if tenants is not None else frozenset()
    if not keys:
        raise NotFound("unknown tenant; use one of the keys file's tenants, or - for requests without a key")
    return keys


def _tenants_report(state: AppState, caller: Caller) -> list[dict[str, Any]] | None:
    """Every tenant's row for an operator, the caller's own tenant's row for a tenant's key, None otherwise."""
    tenants = _tenants(state)
    if tenants is None or not (caller.operator or caller.tenant is not None):
        return None
    report = tenants.report()
    if caller.operator:
        return report
    own = tenant_label(caller.tenant or "")
    return [row for row in report if row["tenant"] == own]
