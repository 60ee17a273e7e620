"""`GET /metrics`: every metric family in the Prometheus text format.

Who may read it (issue 45, H2): anyone while no API key is configured; with keys, an operator
only (api/access.py: the admin token, a key with role=operator, or a trusted loopback client).
Its series carry every tenant's name and key ids with their counts (`servewell_tenant_*`,
`servewell_api_key_requests_total`): another tenant's figures, which a tenant's key never opens.
Prometheus scrapes with the admin token or an operator key as its bearer credential.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from servewell.api.openapi import error_responses
from servewell.api.routes_admin import caller_of
from servewell.api.state import AppState, state_dependency
from servewell.engine.control import GetMetricsText
from servewell.errors import NotFound

router = APIRouter(tags=["observability"])


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
            responses=error_responses(401, 403, 404))
async def prometheus_metrics(request: Request, state: AppState = Depends(state_dependency)) -> Response:
    """Every metric family in the Prometheus text format (names in the README); 404 when metrics
    are turned off (`--metrics-enabled false`). With API keys configured, an operator's only (the
    admin token or an operator key as `Authorization: Bearer`, or a trusted loopback client): 401
    without one, 403 for a tenant's key (the series name every tenant and key)."""
    if state.access.enabled:
        caller_of(request, state).require_operator()
    if state.metrics is None:  # the same setting in every process
        raise NotFound("metrics are turned off on this server (--metrics-enabled false)")
    # Rendered where the engine runs, every ingress process's series summed in (api/control_handlers.py).
    return Response(await state.control.run(GetMetricsText()), media_type=CONTENT_TYPE_LATEST)
