"""The tenants' admin API (engine/tenants.py): every tenant's weight, quotas, requests in progress
and counts, and a live change of a tenant's weight or quotas.

Guarded like every /admin route (`require_admin`); each is an operation of the engine's control
plane (engine/control.py), where the one `Tenants` of the server lives, whichever process the
request reached.
"""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field

from servewell.api.body import read_json_patch
from servewell.api.openapi import error_responses
from servewell.api.routes_admin import admin_actor, require_admin
from servewell.api.state import AppState
from servewell.config.strict import StrictModel
from servewell.engine.control import ListTenants, UpdateTenant
from servewell.errors import InvalidInput
from servewell.tenancy.policy import MAX_QUOTA, MAX_WEIGHT

router = APIRouter(prefix="/admin", tags=["admin"])

Quota = Annotated[int, Field(ge=1, le=MAX_QUOTA)]


class TenantPatch(StrictModel, json_schema_extra={"minProperties": 1}):
    """The body of `PATCH /admin/tenants/{tenant}`: the fields to change (null: back to the keys
    file's value), with the keys file's bounds."""

    weight: Annotated[float, Field(gt=0, le=MAX_WEIGHT, description="Share of a model's batches.")] | None = None
    rate_per_s: Annotated[float, Field(gt=0, le=float(MAX_QUOTA), description="Requests per second.")] | None = None
    max_concurrent: Annotated[Quota, Field(description="Requests in progress, all models.")] | None = None
    max_queued: Annotated[Quota, Field(description="Requests queued per model.")] | None = None


@router.get("/tenants", summary="Tenants: weights, quotas and counts", responses=error_responses(401, 403))
async def get_tenants(state: AppState = Depends(require_admin)) -> Response:
    """Each tenant of the keys in force ("-": requests without a key): weight, quotas (null: none),
    admin overrides in force, requests in progress, and requests by result since the server
    started (admitted, over_rate, over_concurrency, over_queue)."""
    return Response(orjson.dumps({"tenants": await state.control.run(ListTenants())}), media_type="application/json")


@router.patch("/tenants/{tenant}", summary="Change a tenant's weight or quotas while serving",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": TenantPatch.model_json_schema()}}}},
              responses=error_responses(400, 401, 403, 404, 413, 415, 422))
async def patch_tenant(tenant: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Apply the given fields at once (the next request and batch use them); `null` returns a
    field to the keys file's value. Lasts until the keys file changes or the server restarts.
    404 for a tenant the keys file does not name."""
    patch = await read_json_patch(request, state.settings.max_body_bytes, TenantPatch)
    changes = patch.model_dump(exclude_unset=True)
    if not changes:
        raise InvalidInput("name at least one of weight, rate_per_s, max_concurrent, max_queued")
    changed = await state.control.run(UpdateTenant(tenant, changes, actor=admin_actor(request)))
    return Response(orjson.dumps(changed), media_type="application/json")
