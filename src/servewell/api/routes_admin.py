"""Operator endpoints: live batching settings per model, profiling, the active configuration, and
the repository extension's load/unload. Guarded by the access rule (api/access.py): the admin
token, an operator key, or a trusted loopback client; a tenant's key never opens them."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from servewell.api.access import Caller, access_rule, came_through_proxy
from servewell.api.body import read_json_patch
from servewell.api.openapi import error_responses
from servewell.api.state import AppState, state_dependency
from servewell.config.batching import BatchingPatch
from servewell.config.rollout import TrafficPatch
from servewell.engine.control import (
    GetAudit,
    GetBatching,
    GetConfigReport,
    GetRollout,
    LoadModel,
    ProfileModel,
    UnloadModel,
    UpdateBatching,
    UpdateRollout,
)
from servewell.engine.protocol import ModelView
from servewell.observability.audit import actor_name

router = APIRouter(prefix="/admin", tags=["admin"])
#: The OIP model-repository extension (Triton's load/unload), guarded like /admin.
repository_router = APIRouter(prefix="/v2/repository", tags=["Open Inference Protocol v2"])

_ADMIN_ERRORS = (401, 403, 404)


def caller_of(request: Request, state: AppState) -> Caller:
    """Who `request` is by the access rule (api/access.py), with the keys in force now."""
    headers = request.headers
    return access_rule(state.settings, state.access).caller(headers.get("authorization"), headers.get("x-api-key"),
                       request.client.host if request.client is not None else None,
                       proxied=came_through_proxy(headers.keys()))


async def require_admin(request: Request, state: AppState = Depends(state_dependency)) -> AppState:
    """The operator part of the access rule (api/access.py): 401 without the configured bearer
    token or an operator key; 403 for a tenant's key, and, with no token configured, for a client
    that is not on loopback or came through a proxy."""
    name = request.path_params.get("name")
    if isinstance(name, str):
        state.plane.note_model(name)  # model label and log field, for names of this server only
    caller = caller_of(request, state)
    caller.require_operator()
    request.state.admin_actor = actor_name(caller.key.id if caller.key is not None else None)
    return state


def admin_actor(request: Request) -> str:
    """Who an admin request is in the audit trail (`key <id>` or `admin`: observability/audit.py),
    as `require_admin` found it."""
    return str(getattr(request.state, "admin_actor", actor_name(None)))


@router.get("/config", summary="Active configuration", responses=error_responses(*_ADMIN_ERRORS))
async def active_config(state: AppState = Depends(require_admin)) -> Response:
    """The server settings, API key ids and every model's config in force, when each was loaded
    (Unix time), admin overrides, and file changes that wait for a restart. Secrets are left out."""
    return Response(orjson.dumps(await state.control.run(GetConfigReport())), media_type="application/json")


@router.get("/models/{name}/batching", summary="Live batching settings",
            responses=error_responses(*_ADMIN_ERRORS, 503))
async def get_batching(name: str, state: AppState = Depends(require_admin)) -> Response:
    """The model's current batching settings."""
    return Response(orjson.dumps(await state.control.run(GetBatching(name))), media_type="application/json")


@router.patch(
    "/models/{name}/batching",
    summary="Change batching settings while serving",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": BatchingPatch.model_json_schema()}}}},
    responses=error_responses(400, *_ADMIN_ERRORS, 409, 413, 415, 422, 503),
)
async def patch_batching(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Apply the given fields, all or none; queued and running requests are kept; `null` returns a
    field to model.yaml's value. Each field is bounded to values that cannot stop the model (422
    naming the field and the bound). 409 when the model is unloaded, failed or being unloaded. The
    change lasts until the model's model.yaml next changes or the server restarts."""
    patch = await read_json_patch(request, state.settings.max_body_bytes, BatchingPatch)
    changed = await state.control.run(UpdateBatching(name, patch.changes(), actor=admin_actor(request)))
    return Response(orjson.dumps(changed), media_type="application/json")


@router.get("/models/{name}/rollout", summary="A model's traffic split, shadow and rollback state",
            responses=error_responses(*_ADMIN_ERRORS))
async def get_rollout(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Weights in force and in model.yaml, each version's state, the shadow's agreement, the rules'
    window per version (requests, error rate, p99) and the last verdict with its evidence. 404 when
    the model splits no traffic."""
    return Response(orjson.dumps(await state.control.run(GetRollout(name))), media_type="application/json")


@router.patch(
    "/models/{name}/rollout",
    summary="Change a model's traffic weights or shadow share while serving",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": TrafficPatch.model_json_schema()}}}},
    responses=error_responses(400, *_ADMIN_ERRORS, 409, 413, 415, 422),
)
async def patch_rollout(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """`traffic` (weights per loaded version) and/or `shadow_percent`; null returns a field to
    model.yaml's value. Clears a rollback or promotion (the admin decided). Lasts until the
    model's model.yaml changes its traffic or the server restarts. 404 for a version that is not
    loaded; 409 when the model splits no traffic."""
    patch = await read_json_patch(request, state.settings.max_body_bytes, TrafficPatch)
    changed = await state.control.run(UpdateRollout(name, patch, actor=admin_actor(request)))
    return Response(orjson.dumps(changed), media_type="application/json")


@router.post("/models/{name}/profile", summary="Profile a model worker (Chrome/Perfetto trace)",
             responses=error_responses(*_ADMIN_ERRORS, 409, 422, 503))
async def profile(name: str, seconds: Annotated[float, Query(gt=0, le=60)] = 5.0,
                  instance: Annotated[int, Query(ge=0)] = 0, state: AppState = Depends(require_admin)) -> Response:
    """Capture `seconds` (at most 60) of one instance's batches with torch's profiler (kineto) or
    onnxruntime's, plus the worker's Python stack sampled at 100 Hz (a track of its own, named
    by function); returns a trace file that chrome://tracing and ui.perfetto.dev open. The model
    keeps serving meanwhile. One capture per model and two across models at a time (409 beyond)."""
    trace = await state.control.run(ProfileModel(name, instance, seconds))
    return Response(trace, media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{name}-{instance}-profile.json"'})


@router.get("/audit", summary="The audit trail: who changed what, when, from what to what",
            responses=error_responses(*_ADMIN_ERRORS, 422))
async def audit_trail(since: Annotated[float | None, Query(ge=0, description="Unix time: only later changes.")] = None,
                      limit: Annotated[int, Query(ge=1, le=500, description="At most this many, the latest.")] = 100,
                      target: Annotated[str | None, Query(max_length=200, description="A model, a tenant or a file "
                                                          "(its label) only.")] = None,
                      state: AppState = Depends(require_admin)) -> Response:
    """Every change of settings, keys, model files, versions, traffic weights, caches and tenants the
    server applied (the admin API, a file reload, SIGHUP, an automatic rollback or promotion), oldest
    first: `at` (Unix time), `who` (`key <id>`, `admin`, `file`, `SIGHUP`, `rollout rules`), `via`,
    `what`, `target`, `old`, `new` and a `summary`. Secrets are never recorded (`(set)`, `(changed)`).
    The server keeps the latest 500; each is also one log line (`event: audit`)."""
    changes = await state.control.run(GetAudit(since, limit, target))
    return Response(orjson.dumps({"changes": changes}), media_type="application/json")


def _state(view: ModelView) -> dict[str, Any]:
    return {"name": view.name, "version": view.version, "state": view.state, "reason": view.reason}


@repository_router.post("/models/{name}/load", summary="Load or reload a model (zero failed requests)",
                        responses=error_responses(*_ADMIN_ERRORS, 422, oip=True))
async def load_model(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Read the model's directory again and load it; the new version warms up before traffic moves."""
    view = await state.control.run(LoadModel(name, actor=admin_actor(request)))
    return Response(orjson.dumps(_state(view)), media_type="application/json")


@repository_router.post("/models/{name}/unload", summary="Unload a model",
                        responses=error_responses(*_ADMIN_ERRORS, oip=True))
async def unload_model(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Finish the model's queued and running requests, then stop its workers."""
    view = await state.control.run(UnloadModel(name, actor=admin_actor(request)))
    return Response(orjson.dumps(_state(view)), media_type="application/json")
