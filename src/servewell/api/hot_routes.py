"""The inference routes without FastAPI's per-request routing and dependency solving.

FastAPI answered an inference request by matching its path against the routes one regex at a
time, then solving the endpoint's dependencies, wrapping it in an exit stack and an exception
layer: about 28% of the frontend's busy CPU on the tiny MLP (py-spy, 32 clients, OIP JSON).
Without them the frontend spent 0.65-0.69x the CPU per request with JSON tensors and 0.63x with
binary ones (`bench.frontend_cost --tensors json,binary`, against the commit before).

`HotRouteDispatcher` sits innermost among our middlewares, after the request id, the trace, the
timer and the API key, and hands `POST` to an inference path straight to the endpoint function
FastAPI has registered for it: one split of the path and a dictionary lookup.

FastAPI keeps the routes, so /openapi.json documents them as before, and every request the
dispatcher does not take (another method, a trailing slash, an empty or extra segment, a
`root_path`) goes through FastAPI, which answers it exactly as it did (404, 405 with `Allow`,
307, HEAD). Only a path FastAPI routes to the same endpoint with the same parameters is taken.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from servewell.errors import ServeError

#: An inference endpoint as the dispatcher calls it: the request and its path parameters.
HotEndpoint = Callable[[Request, Mapping[str, str]], Awaitable[Response]]
#: The JSON error response for a `ServeError` on a path: the one FastAPI's handler gives.
ErrorResponder = Callable[[ServeError, str], Response]


@dataclass(frozen=True, slots=True)
class HotRoute:
    """One inference route: method, path template (as FastAPI registers it, e.g.
    `/v2/models/{name}/infer`) and the endpoint. Also what `scope["route"]` holds while it runs,
    so metrics, spans and logs name the template as they did."""

    method: str
    path: str
    endpoint: HotEndpoint = field(compare=False)
    _literals: tuple[tuple[int, str], ...] = field(init=False, repr=False, compare=False)
    _params: tuple[tuple[int, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = self.path.split("/")
        if not self.path.startswith("/") or any(p == "" for p in parts[1:]):
            raise ValueError(f"route template {self.path!r} must be absolute, without empty segments")
        params = tuple((i, p[1:-1]) for i, p in enumerate(parts) if p.startswith("{") and p.endswith("}"))
        if any(not name.isidentifier() or ":" in name for _, name in params):
            raise ValueError(f"route template {self.path!r}: only plain {{name}} parameters are supported")
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_literals", tuple((i, p) for i, p in enumerate(parts) if not p.startswith("{")))

    @property
    def segments(self) -> int:
        """How many '/'-separated parts a matching path has (the first is the empty one before '/')."""
        return self.path.count("/") + 1

    def match(self, parts: list[str]) -> dict[str, str] | None:
        """The path parameters when `parts` (a path split on '/') matches, else None. A parameter
        matches one non-empty segment, as Starlette's `[^/]+` does."""
        for i, literal in self._literals:
            if parts[i] != literal:
                return None
        params = {}
        for i, name in self._params:
            value = parts[i]
            if not value:
                return None
            params[name] = value
        return params


class HotRouteTable:
    """The inference routes by method and segment count: matching a path costs one `split` and
    comparing the few literals of at most a couple of candidates."""

    def __init__(self, routes: Iterable[HotRoute]) -> None:
        self._by_shape: dict[tuple[str, int], list[HotRoute]] = {}
        for route in routes:
            self._by_shape.setdefault((route.method, route.segments), []).append(route)

    @property
    def routes(self) -> list[HotRoute]:
        """Every route of the table."""
        return [route for candidates in self._by_shape.values() for route in candidates]

    def match(self, method: str, path: str) -> tuple[HotRoute, dict[str, str]] | None:
        """The route for `method` on `path` (decoded, as in `scope["path"]`) and its parameters, or None."""
        parts = path.split("/")
        candidates = self._by_shape.get((method, len(parts)))
        if candidates is None:
            return None
        for route in candidates:
            params = route.match(parts)
            if params is not None:
                return route, params
        return None


class HotRouteDispatcher:
    """ASGI middleware: a request the table matches runs its endpoint here, with `ServeError`s
    answered by `on_error` (the same JSON as FastAPI's handler); everything else goes to `app`.
    `on_dispatch(route)` is called once for each request taken (the fast-path counter)."""

    def __init__(self, app: ASGIApp, table: HotRouteTable, on_error: ErrorResponder,
                 on_dispatch: Callable[[HotRoute], None] | None = None) -> None:
        self.app = app
        self.table = table
        self.on_error = on_error
        self.on_dispatch = on_dispatch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("root_path"):  # FastAPI resolves a root_path; we need not
            await self.app(scope, receive, send)
            return
        found = self.table.match(scope["method"], scope["path"])
        if found is None:
            await self.app(scope, receive, send)
            return
        route, params = found
        scope["route"] = route
        scope["path_params"] = params
        if self.on_dispatch is not None:
            self.on_dispatch(route)
        try:
            response = await route.endpoint(Request(scope, receive, send), params)
        except ServeError as exc:
            response = self.on_error(exc, scope["path"])
        await response(scope, receive, send)
