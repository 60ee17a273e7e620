"""HTTP side of the API keys: every route but the probes, the docs, the console page and its
files, (configurably) /metrics and the admin endpoints (which take the admin token, never an API
key) needs a valid key. The console's data (`/console/api/state`) needs one like inference does."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from servewell.api.errors import serve_error_response
from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.errors import ServeError
from servewell.observability.context import client_var

#: Answered without a key: what load balancers, kubelets and people reading the docs call.
OPEN_PATHS = frozenset(("/healthz", "/v2/health/live", "/v2/health/ready", "/docs", "/docs/oauth2-redirect",
                        "/openapi.json", "/redoc", "/"))  # "/": the console page, which holds no data


def needs_key(path: str, metrics_need_key: bool) -> bool:
    """Whether a request to `path` must present an API key (when keys are configured)."""
    if path in OPEN_PATHS or path.startswith(("/admin/", "/console/assets/")):
        return False
    if path == "/metrics":
        return metrics_need_key
    if path.startswith("/v2/repository/models/") and path.endswith(("/load", "/unload")):
        return False  # admin: the admin token decides
    return True


class ApiKeyMiddleware:
    """Refuses (401/429 JSON) a request without a valid key before any route runs."""

    def __init__(self, app: ASGIApp, access: InferenceAccess, knobs: LiveKnobs) -> None:
        self.app = app
        self.access = access
        self.knobs = knobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.access.enabled or not needs_key(scope["path"],
                                                                              self.knobs.metrics_need_key):
            await self.app(scope, receive, send)
            return
        authorization = api_key = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                authorization = value.decode("latin-1")
            elif key == b"x-api-key":
                api_key = value.decode("latin-1")
        try:
            client = self.access.check(authorization, api_key)
        except ServeError as exc:
            await serve_error_response(exc, path=scope["path"])(scope, receive, send)
            return
        # Not reset here: the request context middleware around this one resets it after recording the
        # request (its slow/failed record names the caller's key, for the console's tenant filter).
        client_var.set(client or "")
        await self.app(scope, receive, send)
