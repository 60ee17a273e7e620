"""Operator endpoints: live batching settings per model. Guarded by `admin_token`."""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from servewell.api.body import check_content_type, read_body
from servewell.api.state import AppState, app_state
from servewell.engine.protocol import ModelView
from servewell.errors import BadRequest, Forbidden, InvalidInput, Unauthorized

router = APIRouter(prefix="/admin", tags=["admin"])
#: The OIP model-repository extension (Triton's load/unload), guarded like /admin.
repository_router = APIRouter(prefix="/v2/repository", tags=["Open Inference Protocol v2"])

_LOOPBACK = ("127.", "::1", "localhost")


def require_admin(request: Request, state: AppState = Depends(app_state)) -> AppState:
    """401 without the configured bearer token; with no token configured, loopback clients only."""
    name = request.path_params.get("name")
    if isinstance(name, str):
        state.plane.note_model(name)  # model label and log field, for names of this server only
    token = state.settings.admin_token
    if token:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("this endpoint needs 'Authorization: Bearer <admin_token>'")
    elif request.client is None or not request.client.host.startswith(_LOOPBACK):
        raise Forbidden("admin endpoints answer loopback clients only unless admin_token is configured")
    return state


@router.get("/models/{name}/batching", summary="Live batching settings")
async def get_batching(name: str, state: AppState = Depends(require_admin)) -> Response:
    """The model's current batching settings."""
    return Response(orjson.dumps(state.engine.batching(name)), media_type="application/json")


@router.patch(
    "/models/{name}/batching",
    summary="Change batching settings while serving",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object",
        "properties": {k: {} for k in ("policy", "max_batch_size", "max_wait_ms", "latency_slo_ms", "max_queue_size",
                                       "default_timeout_ms", "max_consecutive_high", "reserve_instance_for_high")},
    }}}}},
)
async def patch_batching(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Apply the given fields, all or none; queued and running requests are kept."""
    check_content_type(request, ("application/json",))
    try:
        changes: Any = orjson.loads(await read_body(request, state.settings.max_body_bytes))
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(changes, dict) or not changes:
        raise InvalidInput("send a JSON object with the settings to change")
    return Response(orjson.dumps(state.engine.update_batching(name, changes)), media_type="application/json")


@router.post("/models/{name}/profile", summary="Profile a model worker (Chrome/Perfetto trace)")
async def profile(name: str, seconds: float = 5.0, instance: int = 0, state: AppState = Depends(require_admin)) -> Response:
    """Capture `seconds` (at most 60) of one instance's batches with torch.profiler or onnxruntime
    profiling; returns a trace file that chrome://tracing and ui.perfetto.dev open."""
    if not 0 < seconds <= 60:
        raise InvalidInput("seconds must be in (0, 60]")
    trace = await state.engine.profile(name, instance, seconds)
    return Response(trace, media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{name}-{instance}-profile.json"'})


def _state(view: ModelView) -> dict[str, Any]:
    return {"name": view.name, "version": view.version, "state": view.state, "reason": view.reason}


@repository_router.post("/models/{name}/load", summary="Load or reload a model (zero failed requests)")
async def load_model(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Read the model's directory again and load it; the new version warms up before traffic moves."""
    view = await state.engine.load_model(name)
    return Response(orjson.dumps(_state(view)), media_type="application/json")


@repository_router.post("/models/{name}/unload", summary="Unload a model")
async def unload_model(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Finish the model's queued and running requests, then stop its workers."""
    view = await state.engine.unload_model(name)
    return Response(orjson.dumps(_state(view)), media_type="application/json")
