"""`GET /metrics`: every metric family in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from servewell.api.openapi import error_responses
from servewell.api.state import AppState, state_dependency
from servewell.errors import NotFound
from servewell.observability.exposition import render_text

router = APIRouter(tags=["observability"])


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse, responses=error_responses(404))
async def prometheus_metrics(state: AppState = Depends(state_dependency)) -> Response:
    """Every metric family in the Prometheus text format (names in the README); 404 when metrics
    are turned off (`--metrics-enabled false`)."""
    if state.metrics is None:
        raise NotFound("metrics are turned off on this server (--metrics-enabled false)")
    await state.console.view.refresh()  # ingress processes' series, summed in (bounded wait)
    # in slices, the loop served between them (35,000 lines with 200 models: observability/exposition.py)
    return Response(await render_text(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
