"""The inference dispatcher (api/hot_routes.py): which requests it takes past FastAPI's routing,
with which parameters, and that everything else reaches FastAPI untouched."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Mapping
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from app_state import bare_state
from servewell.api import routes_simple, routes_v2
from servewell.api.app import create_app
from servewell.api.errors import error_response
from servewell.api.hot_routes import HotRoute, HotRouteDispatcher, HotRouteTable
from servewell.errors import NotFound, ServeError

INFER = "/v2/models/{name}/infer"
INFER_VERSION = "/v2/models/{name}/versions/{version}/infer"
PREDICT = "/predict"




async def echo(request: Request, params: Mapping[str, str]) -> Response:
    return Response(orjson.dumps({"params": dict(params), "route": request.scope["route"].path}), 200)


def table() -> HotRouteTable:
    return HotRouteTable([HotRoute("POST", PREDICT, echo), HotRoute("POST", INFER, echo),
                          HotRoute("POST", INFER_VERSION, echo)])


@pytest.mark.parametrize(
    "path,template,params",
    [
        ("/v2/models/mlp/infer", INFER, {"name": "mlp"}),
        ("/v2/models/mlp/versions/3/infer", INFER_VERSION, {"name": "mlp", "version": "3"}),
        ("/predict", PREDICT, {}),
        # scope["path"] is percent-decoded by the server: the name is what the client encoded.
        ("/v2/models/m lp é/infer", INFER, {"name": "m lp é"}),
        ("/v2/models/versions/infer", INFER, {"name": "versions"}),
        ("/v2/models/infer/infer", INFER, {"name": "infer"}),
        # An encoded '/' (%2F) is a '/' by then: it splits the name, as Starlette's routing does.
        ("/v2/models/a/versions/b/infer", INFER_VERSION, {"name": "a", "version": "b"}),
    ],
)
def test_inference_paths_match_with_their_parameters(path, template, params):
    found = table().match("POST", path)
    assert found is not None
    route, got = found
    assert route.path == template and got == params


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "post"])
def test_other_methods_are_left_to_fastapi(method):
    for path in ("/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer", "/predict"):
        assert table().match(method, path) is None


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/mlp/infer/",  # trailing slash: FastAPI redirects (307) as before
        "/predict/",
        "/v2/models//infer",  # empty name: FastAPI answers 404
        "/v2/models/mlp/versions//infer",
        "/v2/models/a/b/infer",  # an encoded '/' in the name
        "/v2/models/mlp/infer/x",
        "/v2/models/mlp/inference",
        "/v2/models/mlp",
        "/v2/model/mlp/infer",
        "/v2/models/mlp/infer\n",  # Starlette's `$` would match before a final newline: FastAPI decides
        "/V2/models/mlp/infer",
        "v2/models/mlp/infer",
        "",
        "/",
        "//predict",
    ],
)
def test_anything_else_is_left_to_fastapi(path):
    assert table().match("POST", path) is None


SEGMENT = st.one_of(st.sampled_from(["v2", "models", "versions", "infer", "predict", "mlp", "1", ""]),
                    st.text(string.ascii_letters + "%/ \n.é-_", max_size=6))


@given(st.lists(SEGMENT, max_size=8))
def test_every_path_taken_is_routed_by_starlette_to_the_same_template_and_parameters(segments):
    path = "/" + "/".join(segments)
    found = table().match("POST", path)
    starlette = None
    for template in (PREDICT, INFER, INFER_VERSION):  # no two of them match one path
        m = compile_path(template)[0].match(path)
        if m is not None:
            starlette = template, m.groupdict()
    if found is not None:
        assert starlette == (found[0].path, found[1])
    elif not path.endswith("\n"):
        assert starlette is None


def test_templates_the_dispatcher_cannot_match_like_starlette_are_refused():
    for bad in ("/v2/models/{name:path}/infer", "v2/infer", "/v2//infer", "/v2/{}/infer"):
        with pytest.raises(ValueError):
            HotRoute("POST", bad, echo)


class Fallback:
    """The rest of the app: records what reached it."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append((scope["method"], scope["path"]))
        await Response(b"fastapi", 404)(scope, receive, send)


def call(app: Any, method: str, path: str, **scope_extra: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"", "root_path": "",
             **scope_extra}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return scope, sent


def on_error(exc: ServeError, path: str) -> Response:
    return error_response(exc.status, exc.code, exc.message, path=path)


def test_a_matched_request_runs_its_endpoint_with_the_route_in_scope_and_is_counted():
    fallback, taken = Fallback(), []
    app = HotRouteDispatcher(fallback, table(), on_error, taken.append)
    scope, sent = call(app, "POST", "/v2/models/mlp/versions/2/infer")
    assert orjson.loads(sent[1]["body"]) == {"params": {"name": "mlp", "version": "2"}, "route": INFER_VERSION}
    assert scope["route"].path == INFER_VERSION and scope["path_params"] == {"name": "mlp", "version": "2"}
    assert fallback.paths == [] and [r.path for r in taken] == [INFER_VERSION]


def test_everything_else_reaches_the_app_untouched():
    fallback, taken = Fallback(), []
    app = HotRouteDispatcher(fallback, table(), on_error, taken.append)
    for method, path in [("GET", "/v2/models/mlp/infer"), ("POST", "/v2/models/mlp/infer/"), ("POST", "/healthz")]:
        scope, sent = call(app, method, path)
        assert sent[0]["status"] == 404 and "route" not in scope
    # Under a root_path, FastAPI strips it before routing; the dispatcher leaves those to it.
    call(app, "POST", "/api/v2/models/mlp/infer", root_path="/api")
    assert fallback.paths == [("GET", "/v2/models/mlp/infer"), ("POST", "/v2/models/mlp/infer/"),
                              ("POST", "/healthz"), ("POST", "/api/v2/models/mlp/infer")]
    assert taken == []


def test_a_serve_error_gets_the_json_error_of_its_path_and_other_errors_propagate():
    async def missing(request: Request, params: Mapping[str, str]) -> Response:
        raise NotFound(f"model '{params.get('name', '')}' is not served here")

    async def broken(request: Request, params: Mapping[str, str]) -> Response:
        raise RuntimeError("a bug")

    app = HotRouteDispatcher(Fallback(), HotRouteTable([HotRoute("POST", INFER, missing),
                                                        HotRoute("POST", PREDICT, missing),
                                                        HotRoute("PUT", PREDICT, broken)]), on_error)
    _, sent = call(app, "POST", "/v2/models/nope/infer")
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 404 and headers[b"x-error-code"] == b"not_found"
    assert orjson.loads(sent[1]["body"])["error"] == "model 'nope' is not served here"  # OIP's shape on /v2
    _, sent = call(app, "POST", "/predict")
    assert orjson.loads(sent[1]["body"])["error"]["code"] == "not_found"
    with pytest.raises(RuntimeError, match="a bug"):  # the request context middleware turns it into a 500
        call(app, "PUT", "/predict")


def test_every_route_the_app_dispatches_is_documented_by_fastapi_for_the_same_method():
    routes = [*routes_simple.hot_routes(), *routes_v2.hot_routes()]
    assert {(r.method, r.path) for r in routes} == {("POST", PREDICT), ("POST", INFER), ("POST", INFER_VERSION)}
    paths = create_app(bare_state()).openapi()["paths"]
    for route in routes:
        assert "requestBody" in paths[route.path][route.method.lower()], route.path
