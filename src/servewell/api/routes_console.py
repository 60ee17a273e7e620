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

The access rule runs here, where the request arrived; the document is built where the engine runs
(api/console_document.py, the `GetConsoleState` control operation) for the caller's scope.
"""

from __future__ import annotations

import functools
import hashlib
import re
from importlib import resources

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from servewell.api.openapi import error_responses
from servewell.api.routes_admin import caller_of
from servewell.api.state import app_state
from servewell.engine.control import AccessScope, GetConsoleState
from servewell.errors import Forbidden, NotFound
from servewell.observability.console_feed import ALL_MODELS

router = APIRouter(tags=["console"])

#: The files the page may load, and their media types: nothing else under the package is served.
ASSETS = {
    "console.js": "text/javascript; charset=utf-8",
    "oncall.js": "text/javascript; charset=utf-8",
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
    own = caller.tenant
    if own is not None and tenant is not None and tenant != own:  # known or not: a 404 would tell which exist
        raise Forbidden(f"this API key belongs to tenant '{own}', which sees its own requests only: another "
                        "tenant's need the admin token or an operator key (role=operator)")
    scope = AccessScope(caller.operator, own, caller.key.id if caller.key is not None else None,
                        caller.denial.message if caller.denial is not None else None)
    # Built where the engine runs, every ingress's records summed in: api/console_document.py.
    doc = await state.control.run(GetConsoleState(model, recent, tenant, scope))
    return Response(orjson.dumps(doc), media_type="application/json", headers={"Cache-Control": "no-store"})
