"""Operator endpoints: live batching settings per model. Guarded by `admin_token`."""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from servewell.api.body import check_content_type, read_body
from servewell.api.openapi import error_responses
from servewell.api.state import AppState, app_state
from servewell.engine.protocol import ModelView
from servewell.errors import BadRequest, Forbidden, InvalidInput, Unauthorized, quote

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


class BatchingPatch(BaseModel):
    """Body of `PATCH /admin/models/{name}/batching`: the settings to change (at least one).

    As strict as its JSON schema in /openapi.json: numbers are JSON numbers (5.0 is the integer 5,
    as JSON Schema has it; "5" and true are refused), the flag a JSON boolean. Whether a
    value fits this model (a max_batch_size its warm-up proved, an instance to reserve) is the
    engine's check (422)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    policy: Literal["idle", "window", "adaptive"] = Field(None, description="Batching policy.")  # type: ignore[arg-type]
    max_batch_size: int = Field(None, ge=1, description="Largest batch (at most what warm-up proved).")  # type: ignore[assignment]
    max_wait_ms: float = Field(None, ge=0, description="window policy: longest wait for a fuller batch.")  # type: ignore[assignment]
    latency_slo_ms: float = Field(None, gt=0, description="adaptive policy: p99 target.")  # type: ignore[assignment]
    max_queue_size: int = Field(None, ge=1, description="Requests queued per lane before 503.")  # type: ignore[assignment]
    default_timeout_ms: float = Field(None, gt=0, description="Deadline of a request that names none.")  # type: ignore[assignment]
    max_consecutive_high: int = Field(None, ge=1, description="Higher-lane batches in a row before a lower lane's.")  # type: ignore[assignment]
    reserve_instance_for_high: bool = Field(None, description="Keep one instance for the first lane.")  # type: ignore[assignment]


    @field_validator("*", mode="before")
    @classmethod
    def _json_types_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "reserve_instance_for_high":
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
        elif info.field_name != "policy" and (isinstance(value, (bool, str)) or value is None):
            raise ValueError("must be a number")
        return value


_ADMIN_ERRORS = (401, 403, 404)


@router.get("/models/{name}/batching", summary="Live batching settings", responses=error_responses(*_ADMIN_ERRORS, 503))
async def get_batching(name: str, state: AppState = Depends(require_admin)) -> Response:
    """The model's current batching settings."""
    return Response(orjson.dumps(state.engine.batching(name)), media_type="application/json")


@router.patch(
    "/models/{name}/batching",
    summary="Change batching settings while serving",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": BatchingPatch.model_json_schema()}}}},
    responses=error_responses(400, *_ADMIN_ERRORS, 413, 415, 422, 503),
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
    try:
        patch = BatchingPatch.model_validate(changes)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidInput(f"field {quote('.'.join(str(p) for p in err['loc']))}: {err['msg']}") from None
    updated = state.engine.update_batching(name, patch.model_dump(exclude_unset=True))
    return Response(orjson.dumps(updated), media_type="application/json")


@router.post("/models/{name}/profile", summary="Profile a model worker (Chrome/Perfetto trace)",
             responses=error_responses(*_ADMIN_ERRORS, 409, 422, 503))
async def profile(name: str, seconds: Annotated[float, Query(gt=0, le=60)] = 5.0,
                  instance: Annotated[int, Query(ge=0)] = 0, state: AppState = Depends(require_admin)) -> Response:
    """Capture `seconds` (at most 60) of one instance's batches with torch.profiler or onnxruntime
    profiling; returns a trace file that chrome://tracing and ui.perfetto.dev open."""
    if not 0 < seconds <= 60:
        raise InvalidInput("seconds must be in (0, 60]")
    trace = await state.engine.profile(name, instance, seconds)
    return Response(trace, media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{name}-{instance}-profile.json"'})


def _state(view: ModelView) -> dict[str, Any]:
    return {"name": view.name, "version": view.version, "state": view.state, "reason": view.reason}


@repository_router.post("/models/{name}/load", summary="Load or reload a model (zero failed requests)",
                        responses=error_responses(*_ADMIN_ERRORS, 422))
async def load_model(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Read the model's directory again and load it; the new version warms up before traffic moves."""
    view = await state.engine.load_model(name)
    return Response(orjson.dumps(_state(view)), media_type="application/json")


@repository_router.post("/models/{name}/unload", summary="Unload a model", responses=error_responses(*_ADMIN_ERRORS))
async def unload_model(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Finish the model's queued and running requests, then stop its workers."""
    view = await state.engine.unload_model(name)
    return Response(orjson.dumps(_state(view)), media_type="application/json")
