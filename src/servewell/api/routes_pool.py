"""The model pool's admin API (engine/model_pool.py): pin, unpin, preload and evict a model, and
the pool's facts as /healthz, the repository index and the console show them.

The routes are guarded like every /admin route (`require_admin`: the admin token, or a loopback
client when none is set); each operation is answered by the engine (engine/control.py), in this
process or over the door.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from servewell.api.openapi import error_responses
from servewell.api.routes_admin import admin_actor, require_admin
from servewell.api.state import AppState
from servewell.engine.control import EvictModel, PinModel, PreloadModel, UnpinModel
from servewell.engine.protocol import ModelView

router = APIRouter(prefix="/admin", tags=["admin"])

_ERRORS = (401, 403, 404)


def pool_fields(view: ModelView) -> dict[str, Any]:
    """A model's place in the pool: where it is, whether a request would load it, pin, last use
    (Unix seconds), host memory (estimated from its files; measured of its workers after warm-up,
    kept while it is evicted; what the budget counts for it now, the larger of the two, None while
    it holds nothing), lazy loads and evictions since the server started."""
    return {
        "residency": view.residency,
        "loadable": view.loadable,
        "pinned": view.pinned,
        "last_used_at": view.last_used_at,
        "estimated_bytes": view.estimated_bytes,
        "measured_bytes": view.measured_bytes,
        "budget_bytes": view.budget_bytes,
        "cold_starts": view.cold_starts,
        "evictions": view.evictions,
    }


def _answer(view: ModelView) -> Response:
    doc = {"name": view.name, "version": view.version, **pool_fields(view), "state": view.state,
           "reason": view.reason}
    return Response(orjson.dumps(doc), media_type="application/json")


@router.post("/models/{name}/pin", summary="Pin a model (never evicted)", responses=error_responses(*_ERRORS))
async def pin(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """The model is never evicted, neither to make room nor when idle, until it is unpinned or the
    server restarts (then model.yaml's `pinned` holds again). Does not load it: see preload."""
    return _answer(await state.control.run(PinModel(name, actor=admin_actor(request))))


@router.post("/models/{name}/unpin", summary="Unpin a model", responses=error_responses(*_ERRORS))
async def unpin(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """The model may be evicted again, whatever its model.yaml says, until the server restarts."""
    return _answer(await state.control.run(UnpinModel(name, actor=admin_actor(request))))


@router.post("/models/{name}/preload", summary="Load a model now",
             responses=error_responses(*_ERRORS, 422, 503))
async def preload(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Load the model now if it is not resident (evicting idle models to make room, as its first
    request would); answers once it is resident. Nothing happens to a resident model. 503
    model_loading or model_not_ready when it cannot be loaded now (the message has the numbers)."""
    return _answer(await state.control.run(PreloadModel(name, actor=admin_actor(request))))


@router.post("/models/{name}/evict", summary="Evict a model now",
             responses=error_responses(*_ERRORS, 409))
async def evict(name: str, request: Request, state: AppState = Depends(require_admin)) -> Response:
    """Unload the model now to free its memory (counted as reason `operator`); in lazy mode its
    next request loads it again. 409 when it is pinned, has work in flight or is not resident."""
    return _answer(await state.control.run(EvictModel(name, actor=admin_actor(request))))
