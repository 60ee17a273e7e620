"""What /openapi.json says about errors and bodies: every route's error responses with the JSON
error schema, and request schemas as strict as the server (fuzzed by schemathesis in the tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from servewell.api.codecs.tensors import MAX_DIMS
from servewell.api.errors import is_oip_path
from servewell.api.http_request import TIMEOUT_PATTERN
from servewell.api.model_document import MAX_TIMEOUT_US
from servewell.config.model import OIP_TO_NUMPY
from servewell.engine.lanes import URGENCIES


class ErrorDetail(BaseModel):
    """The `error` member of every error response."""

    code: str = Field(description="Stable machine-readable code, e.g. invalid_input, overloaded.")
    message: str = Field(description="What went wrong, for people (client strings in it are cut short).")
    request_id: str = Field(description="Id of the request (also in the X-Request-ID header).")


class ErrorBody(BaseModel):
    """Body of every 4xx/5xx answer but the Open Inference Protocol's (/v2/...)."""

    model_config = ConfigDict(title="Error")

    error: ErrorDetail


class OipErrorBody(BaseModel):
    """Body of a 4xx/5xx answer on /v2/...: OIP's `{"error": "<message>"}` (what tritonclient and
    KServe clients read), plus servewell's code and request id beside it."""

    model_config = ConfigDict(title="OipError")

    error: str = Field(description="What went wrong, for people (client strings in it are cut short).")
    code: str = Field(description="Stable machine-readable code, e.g. invalid_input, overloaded.")
    request_id: str = Field(description="Id of the request (also in the X-Request-ID header).")


def error_schema_ref(path: str) -> dict[str, str]:
    """The schema reference of error bodies on `path` (a route template or a request path)."""
    return {"$ref": "#/components/schemas/" + ("OipErrorBody" if is_oip_path(path) else "ErrorBody")}


_WHEN = {
    400: "Malformed JSON, bad base64, an undecodable image, bad binary framing.",
    401: "Missing or wrong API key (inference) or admin credential (the admin token or an operator key); with "
         "WWW-Authenticate.",
    403: "An operator's endpoint asked with a tenant's API key (or, with no admin token configured, by a client "
         "that is not on loopback or came through a proxy), or another tenant's data asked with a tenant's key.",
    404: "Unknown model, version or route.",
    408: "The request's head or body arrived slower than the server's timeouts.",
    409: "Conflicts with work in progress (a profile of this model already being captured, or two of others) "
         "or with the model's state (unloaded, failed or being unloaded).",
    413: "Body over max_body_bytes, image over max_image_pixels or max_image_side.",
    415: "A Content-Type this route does not take.",
    422: "Well-formed, but the fields or tensors do not match what the route or model takes.",
    429: "The caller's tenant is over one of its quotas (rate, concurrency, queued requests; code over_quota); "
         "Retry-After says when to try again.",
    503: "Cannot serve this now (model_not_ready, model_loading, model_unloading, model_reloading, overloaded, "
         "deadline_exceeded, worker_lost, shared_memory_full, engine_unavailable, shutting_down); "
         "retry after Retry-After seconds when given.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
_ERROR_CODE = {"X-Error-Code": {"description": "The stable error code (as in the body).", "schema": {"type": "string"}}}


def error_responses(*statuses: int, oip: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` for these statuses, each with the JSON error body (`oip`: OIP's shape,
    for /v2/... routes)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": OipErrorBody if oip else ErrorBody, "description": _WHEN[status],
                                 "headers": {**_ERROR_CODE, **(_RETRY_AFTER if status in (429, 503) else {})}}
        out[status] = entry
    return out


def not_ready_response(description: str) -> dict[int | str, dict[str, Any]]:
    """A 503 whose body is the route's own document (health and readiness routes)."""
    return {503: {"description": description, "headers": _RETRY_AFTER,
                  "content": {"application/json": {"schema": {"type": "object"}}}}}


#: Request headers the inference routes read.
INFERENCE_HEADERS: list[dict[str, Any]] = [
    {"name": "X-Urgency", "in": "header", "required": False, "schema": {"type": "string", "enum": list(URGENCIES)},
     "description": "high: the model's first lane; normal: its default lane; low: its last (a model's own lane "
                    "names are accepted too)."},
    {"name": "X-Request-Timeout-Ms", "in": "header", "required": False,
     "schema": {"type": "string", "pattern": TIMEOUT_PATTERN},
     "description": "Deadline in milliseconds from arrival: a positive decimal number (0 is refused)."},
]

_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype", "data"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "shape": {"type": "array", "maxItems": MAX_DIMS, "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": sorted(OIP_TO_NUMPY)},
        "data": {"type": "array", "description": "Row-major values, flat or nested to the shape; BYTES: strings "
                 "(base64 for encoded images)."},
        "parameters": {"type": "object"},
    },
}

#: OIP's `parameters` of a request: its lane and its deadline.
OIP_PARAMETERS: dict[str, Any] = {
    "priority": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1}],
                 "description": "0: default lane, 1: highest, 2: next...; or a lane name."},
    "timeout": {"type": "integer", "minimum": 0, "maximum": MAX_TIMEOUT_US,
                "description": "Deadline in whole microseconds, as in Triton (0: none, the "
                "model's default_timeout_ms; a whole float such as 5000.0 counts)."},
}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """A required JSON request body of `schema` (for `openapi_extra={"requestBody": ...}`)."""
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def event_stream_response(description: str, json_too: bool = False) -> dict[int | str, dict[str, Any]]:
    """A 200 that is a server-sent event stream (`json_too`: or one JSON document, as the request asks)."""
    content: dict[str, Any] = {"text/event-stream": {"schema": {"type": "string"}}}
    if json_too:
        content["application/json"] = {"schema": {"type": "object"}}
    return {200: {"description": description, "content": content}}


#: Body of OIP `infer` in JSON (the binary extension is documented as application/octet-stream).
INFER_REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {"schema": {
            "title": "InferenceRequest",
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "id": {"type": "string"},
                "parameters": {"type": "object", "properties": {
                    **OIP_PARAMETERS,
                    "binary_data_output": {"type": "boolean"},
                }},
                "inputs": {"type": "array", "minItems": 1, "items": _TENSOR},
                "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"},
                    "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}},
                }}},
            },
        }},
        "application/octet-stream": {"schema": {
            "type": "string", "format": "binary",
            "description": "JSON header (Inference-Header-Content-Length bytes) followed by binary tensors."}},
    },
}


def truthful_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` whose 422s carry our error body: FastAPI documents its own validation error
    (`{"detail": [...]}`) on every route with parameters, which servewell never sends."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generate()
        for path, operations in doc.get("paths", {}).items():
            error_ref = error_schema_ref(path)
            for operation in operations.values():
                responses = operation.get("responses", {})
                response = responses.get("422")
                if response is not None and "HTTPValidationError" in str(response):
                    responses["422"] = {"description": _WHEN[422], "headers": _ERROR_CODE,
                                        "content": {"application/json": {"schema": error_ref}}}
                for response in responses.values():
                    # Errors are JSON whatever the route's own media type (/metrics: text/plain).
                    content = response.get("content", {})
                    if {"schema": error_ref} in content.values() and "application/json" not in content:
                        response["content"] = {"application/json": {"schema": error_ref}}
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
        return doc

    return openapi
