"""The response cache's admin API (engine/response_cache.py): what a model's cache holds and its
counts, and emptying it (after fixing data the model reads, say).

Guarded like every /admin route (`require_admin`); in a split server an ingress forwards them to
the engine's app (api/forward.py), where the one cache of each model lives.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import orjson
from fastapi import APIRouter, Depends
from fastapi.responses import Response

from servewell.api.openapi import error_responses
from servewell.api.routes_admin import require_admin
from servewell.api.state import AppState
from servewell.engine.protocol import ServingEngine
from servewell.engine.response_cache import ResponseCache
from servewell.errors import Conflict, ServeError

router = APIRouter(prefix="/admin", tags=["admin"])


@runtime_checkable
class CacheOwner(Protocol):
    """An engine whose models' caches live in this process (InferenceEngine)."""

    def response_cache(self, name: str) -> ResponseCache | None:
        """The cache of the version serving `name` (None: the model has no `cache:`)."""
        ...


def _cache(engine: ServingEngine, name: str) -> ResponseCache | None:
    if isinstance(engine, CacheOwner):
        return engine.response_cache(name)
    raise ServeError("this process has no response cache; the request should have been forwarded to the engine")


@router.get("/models/{name}/cache", summary="A model's response cache", responses=error_responses(401, 403, 404))
async def get_cache(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Settings (`max_bytes`, `ttl_s`), bytes and answers kept, requests in flight, and counts
    since the version loaded (hit, miss, coalesced, evicted_size, evicted_ttl); `cache` is null
    for a model without `cache:` in its model.yaml."""
    cache = _cache(state.engine, name)
    return Response(orjson.dumps({"model": name, "cache": cache.report() if cache is not None else None}),
                    media_type="application/json")


@router.delete("/models/{name}/cache", summary="Empty a model's response cache",
               responses=error_responses(401, 403, 404, 409))
async def clear_cache(name: str, state: AppState = Depends(require_admin)) -> Response:
    """Drop every kept answer of the model (requests being computed still get theirs); answers
    how many were dropped and the cache as it is now. 409 when the model has no cache."""
    cache = _cache(state.engine, name)
    if cache is None:
        raise Conflict(f"model {name!r} has no response cache (no cache: in its model.yaml)")
    dropped = cache.clear()
    return Response(orjson.dumps({"model": name, "dropped": dropped, "cache": cache.report()}),
                    media_type="application/json")
