"""HTTP side of the API keys: every route but the probes, the docs, the console page and its
files, /metrics and the admin endpoints needs a valid key when keys are configured.

/metrics and the admin endpoints are an operator's (api/access.py): their routes apply the access
rule themselves (the admin token, an operator key, or a trusted loopback client), so no tenant's
key opens them. The console's data (`/console/api/state`) answers an operator without a key, and
anyone else with a key like inference; the route then shows a tenant its own tenant's part only.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from servewell.api.access import AccessRule, came_through_proxy
from servewell.api.errors import serve_error_response
from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.errors import ServeError
from servewell.observability.context import client_var

#: Answered without a key: what load balancers, kubelets and people reading the docs call.
OPEN_PATHS = frozenset(("/healthz", "/v2/health/live", "/v2/health/ready", "/docs", "/docs/oauth2-redirect",
                        "/openapi.json", "/redoc", "/"))  # "/": the console page, which holds no data
#: Answered to an operator without a key (the access rule decides in the route what they show).
OPERATOR_PATHS = frozenset(("/console/api/state",))


def needs_key(path: str) -> bool:
    """Whether a request to `path` must present an API key when keys are configured (an
    operator need not on `OPERATOR_PATHS`). False for the operator-only routes: /metrics, /admin/*
    and the repository's load/unload check the access rule themselves."""
    if path in OPEN_PATHS or path == "/metrics" or path.startswith(("/admin/", "/console/assets/")):
        return False
    if path.startswith("/v2/repository/models/") and path.endswith(("/load", "/unload")):
        return False  # admin: the access rule decides
    return True


class ApiKeyMiddleware:
    """Refuses (401/429 JSON) a request without a valid key before any route runs."""

    def __init__(self, app: ASGIApp, access: InferenceAccess, knobs: LiveKnobs,
                 rule: Callable[[], AccessRule] | None = None) -> None:
        self.app = app
        self.access = access
        self.knobs = knobs
        self.rule = rule  # the access rule with the keys in force (None: nobody is an operator here)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.access.enabled or not needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        authorization = api_key = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                authorization = value.decode("latin-1")
            elif key == b"x-api-key":
                api_key = value.decode("latin-1")
        if scope["path"] in OPERATOR_PATHS and self._operator(scope, authorization, api_key):
            await self.app(scope, receive, send)
            return
        try:
            client = self.access.check(authorization, api_key)
        except ServeError as exc:
            await serve_error_response(exc, path=scope["path"])(scope, receive, send)
            return
        # Not reset here: the request context middleware around this one resets it after recording the
        # request (its slow/failed record names the caller's key, for the console's tenant filter).
        client_var.set(client or "")
        await self.app(scope, receive, send)

    def _operator(self, scope: Scope, authorization: str | None, api_key: str | None) -> bool:
        if self.rule is None:
            return False
        client = scope.get("client")
        host = client[0] if client else None
        rule = self.rule()
        names = (name.decode("latin-1") for name, _ in scope["headers"])
        return rule.caller(authorization, api_key, host, proxied=came_through_proxy(names)).operator
