"""The response cache's admin API (engine/response_cache.py): what a model's cache holds and its
counts, new bounds while serving, and emptying it (after fixing data the model reads, say).

Guarded like every /admin route (`require_admin`); each is an operation of the engine's control
plane (engine/control.py, answered in api/control_handlers.py), where the one cache of each model
lives, whichever process the request reached.
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
from servewell.config.cache import MAX_CACHE_BYTES, MAX_TTL_S
from servewell.config.strict import StrictModel
from servewell.engine.control import ClearCache, GetCache, UpdateCache
from servewell.errors import InvalidInput

router = APIRouter(prefix="/admin", tags=["admin"])


@router.get("/models/{name}/cache", summary="A model's response cache", responses=error_responses(401, 403, 404))
async def get_cache(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Settings (`max_bytes`, `ttl_s`, `shared_across_tenants`), the engine memory the kept answers
    take (`bytes`: their arrays and the cache's records, as `max_bytes` counts them) and how many
    (`entries`; answers past `ttl_s` are not counted), computations in flight, and counts since the
    version loaded (hit, miss, coalesced, evicted_size, evicted_ttl); `cache` is null for a model
    without `cache:` in its model.yaml."""
    return Response(orjson.dumps(await state.control.run(GetCache(name))), media_type="application/json")


class CachePatch(StrictModel, json_schema_extra={"minProperties": 1}):
    """The body of `PATCH /admin/models/{name}/cache`: new bounds, with model.yaml's limits."""

    max_bytes: Annotated[int, Field(ge=1024, le=MAX_CACHE_BYTES, description="Bytes of answers kept.")] | None = None
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S, description="Seconds an answer is served.")] | None = None


@router.patch("/models/{name}/cache", summary="Change a model's response cache bounds while serving",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": CachePatch.model_json_schema()}}}},
              responses=error_responses(400, 401, 403, 404, 409, 413, 415, 422))
async def patch_cache(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """New `max_bytes` (the least recently used answers beyond it go at once) and/or `ttl_s` (for
    answers kept from now on; `null`: back to model.yaml's value), until the model's model.yaml
    next changes or the server restarts. 409 when the model has no cache (a cache is declared in
    model.yaml, never by an admin)."""
    given = (await read_json_patch(request, state.settings.max_body_bytes, CachePatch)).model_dump(exclude_unset=True)
    if not given:
        raise InvalidInput("name max_bytes, ttl_s or both")
    changed = await state.control.run(UpdateCache(name, given, actor=admin_actor(request)))
    return Response(orjson.dumps(changed), media_type="application/json")


@router.delete("/models/{name}/cache", summary="Empty a model's response cache",
               responses=error_responses(401, 403, 404, 409))
async def clear_cache(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Drop every kept answer of the model (requests being computed still get theirs) and hand the
    memory they held back to the system; answers how many were dropped and the cache as it is now.
    409 when the model has no cache."""
    return Response(orjson.dumps(await state.control.run(ClearCache(name, actor=admin_actor(request)))),
                    media_type="application/json")
