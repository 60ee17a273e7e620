"""/openapi.json states the constraints the server enforces: bodies it refuses are invalid in the
schema too, and every error response documents the JSON error body."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import jsonschema_rs  # schemathesis's validator (the test extra installs it)
import pytest

from app_state import bare_state
from servewell.api.app import create_app


@pytest.fixture(scope="module")
def spec() -> dict:
    state = bare_state()
    return create_app(state).openapi()  # type: ignore[arg-type]


def body_schema(spec: dict, path: str, method: str) -> dict:
    return spec["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize(
    "path,method,body",
    [
        ("/predict", "post", {"image_base64": ""}),
        ("/predict", "post", {"image_base64": "not base64!"}),
        ("/predict", "post", {}),
        ("/v2/models/{name}/infer", "post", {"inputs": []}),
        ("/v2/models/{name}/infer", "post", {"inputs": [{"name": "", "shape": [1], "datatype": "FP32", "data": [1]}]}),
        (
            "/v2/models/{name}/infer",
            "post",
            {"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]},
        ),
        (
            "/v2/models/{name}/infer",
            "post",
            {"inputs": [{"name": "x", "shape": [1] * 65, "datatype": "FP32", "data": [1]}]},
        ),
        ("/v2/models/{name}/infer", "post", {"inputs": [{"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}]}),
        (
            "/v2/models/{name}/infer",
            "post",
            {"id": 5, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
        ),
        ("/admin/models/{name}/batching", "patch", {}),
        ("/admin/models/{name}/batching", "patch", {"lanes": ["a"]}),
        ("/admin/models/{name}/batching", "patch", {"max_queue_size": "5"}),
        ("/admin/models/{name}/batching", "patch", {"max_queue_size": 0}),
    ],
)
def test_bodies_the_server_refuses_are_invalid_in_the_schema(spec, path, method, body):
    assert not jsonschema_rs.is_valid(body_schema(spec, path, method), body)


@pytest.mark.parametrize(
    "path,method,body",
    [
        ("/predict", "post", {"image_base64": "iVBORw0KGgo=", "urgency": "high"}),
        (
            "/v2/models/{name}/infer",
            "post",
            {
                "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
                "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
            },
        ),
        ("/admin/models/{name}/batching", "patch", {"max_queue_size": 5, "policy": "window", "max_wait_ms": 2.5}),
    ],
)
def test_valid_bodies_are_valid_in_the_schema(spec, path, method, body):
    assert jsonschema_rs.is_valid(body_schema(spec, path, method), body)


def test_every_error_response_documents_the_json_error_body(spec):
    for path, operations in spec["paths"].items():
        body = "OipErrorBody" if path.startswith("/v2/") else "ErrorBody"  # OIP's string `error` on /v2
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status.startswith("4"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": f"#/components/schemas/{body}"}, (method, path, status)
                    assert "X-Error-Code" in response["headers"], (method, path, status)
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert spec["components"]["schemas"]["OipErrorBody"]["properties"]["error"]["type"] == "string"
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]["responses"]
    assert {"400", "404", "413", "415", "422", "503"} <= set(infer)
    assert "Retry-After" in infer["503"]["headers"]


@pytest.mark.parametrize(
    "method,path,allow",
    [
        ("GET", "/predict", "POST"),
        ("DELETE", "/admin/models/m/batching", "GET, PATCH"),
        ("PUT", "/v2/models/m/versions/1/infer", "POST"),
    ],
)
def test_405_lists_every_documented_method_of_the_resource(method, path, allow):
    state = bare_state()
    app = create_app(state)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path)

    r = asyncio.run(call())
    assert r.status_code == 405 and r.headers["x-error-code"] == "method_not_allowed"
    code = r.json()["code"] if path.startswith("/v2/") else r.json()["error"]["code"]
    assert code == "method_not_allowed"
    assert r.headers["allow"] == allow


@pytest.mark.parametrize(
    "path,oip",
    [("/v2/no-such-route", True), ("/v2/models/m/versions/1/infer/x", True), ("/v2x", False),
     ("/no-such-route", False), ("/admin/nothing", False)],
)
def test_errors_on_oip_routes_carry_the_message_as_error_and_the_rest_beside_it(path, oip):
    async def call():
        transport = httpx.ASGITransport(app=create_app(bare_state()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers={"X-Request-ID": "shape-1"})

    r = asyncio.run(call())
    assert r.status_code == 404 and r.headers["x-error-code"] == "not_found" and r.headers["x-request-id"] == "shape-1"
    doc = r.json()
    if oip:  # OIP: `error` is the message, what tritonclient's InferenceServerException holds
        assert doc == {"error": "Not Found", "code": "not_found", "request_id": "shape-1"}
    else:
        assert doc == {"error": {"code": "not_found", "message": "Not Found", "request_id": "shape-1"}}


def test_no_route_or_dependency_runs_in_the_thread_pool():
    # FastAPI runs a plain-function endpoint or dependency in its thread pool: a thread hop per
    # request (removing the one the state dependency had halved a metadata GET's frontend CPU).
    from fastapi.routing import APIRoute

    def routes(container: Any) -> list[APIRoute]:  # included routers are walked into
        found = []
        for route in container.routes:
            if isinstance(route, APIRoute):
                found.append(route)
            elif getattr(route, "original_router", None) is not None:
                found += routes(route.original_router)
        return found

    def calls(dependant: Any) -> list[Any]:
        return [dependant.call] + [call for sub in dependant.dependencies for call in calls(sub)]

    found = routes(create_app(bare_state()))
    assert len(found) > 20
    blocking = [(route.path, getattr(call, "__name__", call)) for route in found for call in calls(route.dependant)
                if call is not None and not asyncio.iscoroutinefunction(call)]
    assert blocking == []


def test_the_model_pool_admin_routes_are_documented_with_their_errors(spec):
    for action in ("pin", "unpin", "preload", "evict"):
        operation = spec["paths"][f"/admin/models/{{name}}/{action}"]["post"]
        assert operation["tags"] == ["admin"]
        assert {"401", "403", "404"} <= set(operation["responses"]), action
    assert "409" in spec["paths"]["/admin/models/{name}/evict"]["post"]["responses"]
    assert {"422", "503"} <= set(spec["paths"]["/admin/models/{name}/preload"]["post"]["responses"])
