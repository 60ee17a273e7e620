"""Open Inference Protocol v2 REST (as KServe and Triton serve it), plus Triton's extensions
that `tritonclient` uses: model config, repository index, binary tensor data."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

import servewell
from servewell.api.body import check_content_type, read_body
from servewell.api.codecs.tensors import infer_response_steps, parse_infer_request
from servewell.api.dataplane import select_outputs
from servewell.api.hot_routes import HotRoute
from servewell.api.http_request import disconnected, timeout_ms_of, urgency_of
from servewell.api.model_document import TRITON_STATES, config_json, metadata_json, model_document, timeout_us_of
from servewell.api.openapi import INFER_REQUEST_BODY, INFERENCE_HEADERS, error_responses, not_ready_response
from servewell.api.response_writes import parts_response
from servewell.api.routes_pool import pool_fields
from servewell.api.state import AppState, app_state, state_dependency
from servewell.engine.control import CheckLive, DescribeModel, GetReadiness, ListModels
from servewell.engine.protocol import ModelView
from servewell.errors import BadRequest, PayloadTooLarge, quote

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol v2"])



def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc), status, headers, "application/json")


@router.get("", summary="Server metadata")
async def server_metadata() -> Response:
    """Name, version and supported protocol extensions."""
    return _json({
        "name": "servewell",
        "version": servewell.__version__,
        "extensions": ["binary_tensor_data", "model_repository", "classification_free_parameters"],
    })


@router.get("/health/live", summary="Liveness")
async def health_live(state: AppState = Depends(state_dependency)) -> Response:
    """200 while the server process answers."""
    # A split server is live while its engine answers: 503 engine_unavailable when it is gone, as
    # the route answered when it was relayed to the engine.
    await state.control.run(CheckLive())
    return _json({"live": True})


@router.get("/health/ready", summary="Readiness", responses=not_ready_response("Not ready: {\"ready\": false}."))
async def health_ready(state: AppState = Depends(state_dependency)) -> Response:
    """200 when the server should receive traffic (by its readiness policy: --readiness), 503 (with
    Retry-After) otherwise."""
    ready = (await state.control.run(GetReadiness())).ready
    return _json({"ready": ready}, 200 if ready else 503, None if ready else {"Retry-After": "2"})


def _metadata(view: ModelView) -> dict[str, Any]:
    """OIP metadata (model_document.py, as gRPC tells it) plus our state and parameters; a model whose
    model.yaml is invalid gets its state and reason only."""
    config = view.config
    if config is None:
        return {"name": view.name, "versions": list(view.versions) or [view.version], "state": view.state,
                "reason": view.reason}
    doc = metadata_json(model_document(view))
    doc["state"] = view.state
    doc["parameters"] = {"max_batch_size": config.max_batch_size, **config.metadata}
    if view.scheduling is not None and config.max_batch_size:
        doc["parameters"]["effective_max_batch_size"] = view.scheduling.max_batch_size
    if view.serving_dtype:
        doc["parameters"]["serving_dtype"] = view.serving_dtype  # what dtype auto chose, after warm-up
    if config.image_input:
        doc["parameters"]["image_input"] = config.image_input + " (also accepts BYTES: encoded images)"
    return doc


@router.get("/models/{name}", summary="Model metadata", responses=error_responses(404, oip=True))
@router.get("/models/{name}/versions/{version}", summary="Model metadata (version)",
            responses=error_responses(404, oip=True))
async def model_metadata(name: str, version: str | None = None,
                         state: AppState = Depends(state_dependency)) -> Response:
    """Inputs, outputs, platform and versions of a model."""
    state.plane.note_model(name)
    return _json(_metadata(await state.control.run(DescribeModel(name, version))))


_MODEL_READY_RESPONSES = {**error_responses(404, oip=True),
                          **not_ready_response("The model is not ready (ready: false, its state).")}


@router.get("/models/{name}/ready", summary="Model readiness",
            responses=_MODEL_READY_RESPONSES)
@router.get("/models/{name}/versions/{version}/ready", summary="Model readiness (version)",
            responses=_MODEL_READY_RESPONSES)
async def model_ready(name: str, version: str | None = None, state: AppState = Depends(state_dependency)) -> Response:
    """200 when the model is ready, or (lazy mode) loadable: its first request loads it; 503
    otherwise. `residency` says which (resident, loading, evicted, not_loaded...)."""
    state.plane.note_model(name)
    view = await state.control.run(DescribeModel(name, version))
    ready = view.state == "ready" or view.loadable
    doc = {"name": name, "ready": ready, "state": view.state, "residency": view.residency, "loadable": view.loadable}
    if view.reason:
        doc["reason"] = view.reason
    return _json(doc, 200 if ready else 503, None if ready else {"Retry-After": "2"})


@router.get("/models/{name}/config", summary="Model configuration (Triton extension)",
            responses=error_responses(404, 422, oip=True))
@router.get("/models/{name}/versions/{version}/config", summary="Model configuration (version)",
            responses=error_responses(404, 422, oip=True))
async def model_config(name: str, version: str | None = None, state: AppState = Depends(state_dependency)) -> Response:
    """The model's configuration in Triton's field names, as `tritonclient.get_model_config` expects: the
    same fields and values as gRPC's ModelConfig (model_document.py)."""
    state.plane.note_model(name)
    return _json(config_json(model_document(await state.control.run(DescribeModel(name, version)))))


@router.post("/repository/index", summary="Repository index")
async def repository_index(state: AppState = Depends(state_dependency)) -> Response:
    """Every model of the repository with its state and, if not ready, the reason; beside them
    (servewell's extension) its place in the model pool: residency (resident, loading, evicted,
    not_loaded, failed, invalid), loadable, pinned, last_used_at, estimated_bytes, cold_starts and
    evictions."""
    entries = []
    for view in await state.control.run(ListModels()):
        entry: dict[str, Any] = {"name": view.name, "version": view.version,
                                 "state": TRITON_STATES.get(view.state, "UNAVAILABLE")}
        if view.reason:
            entry["reason"] = view.reason
        entry.update(pool_fields(view))
        entries.append(entry)
    return _json(entries)


_INFER_EXTRA = {"requestBody": INFER_REQUEST_BODY, "parameters": INFERENCE_HEADERS}
_INFER_ERRORS = error_responses(400, 401, 404, 408, 413, 415, 422, 429, 503, oip=True)


INFER_PATH = "/models/{name}/infer"
INFER_VERSION_PATH = "/models/{name}/versions/{version}/infer"


@router.post(INFER_PATH, summary="Inference", openapi_extra=_INFER_EXTRA, responses=_INFER_ERRORS)
@router.post(INFER_VERSION_PATH, summary="Inference (version)", openapi_extra=_INFER_EXTRA, responses=_INFER_ERRORS)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    """Run the model on JSON (or binary-extension) tensors."""
    state = app_state(request)
    call = state.plane.call()
    model = await call.open(name, version, urgency_of(request))  # 404/503 before reading and decoding the body
    check_content_type(request, ("application/json", "application/octet-stream"))
    with call.receiving():
        body = await read_body(request, state.settings.max_body_bytes)
    limit = state.settings.max_body_bytes
    with call.preprocessing():
        body = _decompress(body, request.headers.get("content-encoding"), limit)
        parsed = parse_infer_request(body, _header_length(request))
        inputs = await call.model_inputs(parsed.inputs, parsed.parameters.get("priority"))
    header_timeout = timeout_ms_of(request)
    result = await call.infer(
        inputs, priority=parsed.parameters.get("priority"),
        timeout_ms=header_timeout if header_timeout is not None else _timeout_ms(parsed.parameters),
        disconnected=disconnected(request), oip_id=parsed.id,
    )
    outputs = select_outputs(name, result.outputs, parsed.requested_outputs)
    binary = set(outputs) if parsed.all_binary else parsed.binary_outputs
    version = result.version or model.config.version  # a traffic split may have drawn another version
    # A large answer is encoded in steps, the event loop taking turns, and sent as its parts.
    answer = await call.encode(outputs, infer_response_steps(name, version, parsed.id, outputs, binary))
    headers = {"Server-Timing": call.finish(result), "X-Model-Version": version}
    if answer.json_length is None:
        return parts_response(answer.parts, 200, headers, "application/json")
    headers["Inference-Header-Content-Length"] = str(answer.json_length)
    return parts_response(answer.parts, 200, headers, "application/octet-stream")


def hot_routes() -> list[HotRoute]:
    """`infer` for the dispatcher that runs it without FastAPI's routing (api/hot_routes.py);
    FastAPI keeps the same routes for /openapi.json and for the requests the dispatcher leaves."""

    async def endpoint(request: Request, params: Mapping[str, str]) -> Response:
        return await infer(params["name"], request, params.get("version"))

    return [HotRoute("POST", router.prefix + INFER_PATH, endpoint),
            HotRoute("POST", router.prefix + INFER_VERSION_PATH, endpoint)]


def _header_length(request: Request) -> int | None:
    raw = request.headers.get("inference-header-content-length")
    if raw is None:
        return None
    text = raw.strip()
    if not (0 < len(text) <= 12 and text.isascii() and text.isdigit()):
        raise BadRequest(f"Inference-Header-Content-Length must be a byte count, got {quote(raw)}")
    return int(text)


def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    if not encoding or encoding.lower() == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise BadRequest(f"Content-Encoding {quote(encoding)} is not supported (gzip, deflate)")
    decompressor = zlib.decompressobj(wbits)
    try:
        out = decompressor.decompress(body, limit + 1)
    except zlib.error:
        raise BadRequest(f"body is not valid {encoding} data") from None
    if len(out) > limit or decompressor.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed body exceeds the limit of {limit} bytes")
    if not decompressor.eof:
        raise BadRequest(f"body is truncated {encoding} data")
    if decompressor.unused_data:  # junk after the stream: what else the client meant is anyone's guess
        raise BadRequest(f"body has bytes after the end of its {encoding} data")
    return out


def _timeout_ms(parameters: dict[str, Any]) -> float | None:
    """Deadline from OIP `parameters.timeout` (microseconds, the rule of model_document.timeout_us_of)."""
    timeout_us = timeout_us_of(parameters.get("timeout"))
    return timeout_us / 1000.0 if timeout_us is not None else None
