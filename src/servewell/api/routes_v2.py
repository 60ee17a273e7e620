"""Open Inference Protocol v2 REST (as KServe and Triton serve it), plus Triton's extensions
that `tritonclient` uses: model config, repository index, binary tensor data."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

import servewell
from servewell.api.body import check_content_type, read_body
from servewell.api.codecs.image import decode_base64
from servewell.api.codecs.tensors import DecodedTensor, encode_infer_response, parse_infer_request
from servewell.api.context import (
    ApiContext,
    api_context,
    server_timing,
    stage_span,
    timeout_from_header,
    unless_disconnected,
)
from servewell.config.model import ModelConfig
from servewell.engine.engine import ModelView
from servewell.engine.validation import expected_shape
from servewell.errors import BadRequest, InvalidInput, PayloadTooLarge
from servewell.observability.context import model_var, request_id_var

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol v2"])

PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pytorch": "pytorch"}
TRITON_STATES = {"ready": "READY", "loading": "LOADING", "restarting": "LOADING"}


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
async def health_live(api: ApiContext = Depends(api_context)) -> Response:
    """200 while the server process answers."""
    return _json({"live": api.engine.live})


@router.get("/health/ready", summary="Readiness")
async def health_ready(api: ApiContext = Depends(api_context)) -> Response:
    """200 when every valid model is ready, 503 (with Retry-After) otherwise."""
    ready = api.engine.ready
    return _json({"ready": ready}, 200 if ready else 503, None if ready else {"Retry-After": "2"})


def _metadata(view: ModelView) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": view.name, "versions": [view.version], "state": view.state}
    config = view.config
    if config is None:
        doc["reason"] = view.reason
        return doc
    doc["platform"] = PLATFORMS[config.runtime]
    doc["inputs"] = [
        {"name": t.name, "datatype": t.datatype, "shape": expected_shape(config, t)} for t in config.inputs
    ]
    doc["outputs"] = [
        {"name": t.name, "datatype": t.datatype, "shape": expected_shape(config, t)} for t in config.outputs
    ]
    doc["parameters"] = {"max_batch_size": config.max_batch_size, **config.metadata}
    if config.image_input:
        doc["parameters"]["image_input"] = config.image_input + " (also accepts BYTES: encoded images)"
    return doc


@router.get("/models/{name}", summary="Model metadata")
@router.get("/models/{name}/versions/{version}", summary="Model metadata (version)")
async def model_metadata(name: str, version: str | None = None, api: ApiContext = Depends(api_context)) -> Response:
    """Inputs, outputs, platform and versions of a model."""
    return _json(_metadata(api.engine.model(name, version)))


@router.get("/models/{name}/ready", summary="Model readiness")
@router.get("/models/{name}/versions/{version}/ready", summary="Model readiness (version)")
async def model_ready(name: str, version: str | None = None, api: ApiContext = Depends(api_context)) -> Response:
    """200 when the model is ready, 503 otherwise."""
    view = api.engine.model(name, version)
    ready = view.state == "ready"
    doc = {"name": name, "ready": ready, "state": view.state}
    if view.reason:
        doc["reason"] = view.reason
    return _json(doc, 200 if ready else 503, None if ready else {"Retry-After": "2"})


@router.get("/models/{name}/config", summary="Model configuration (Triton extension)")
@router.get("/models/{name}/versions/{version}/config", summary="Model configuration (version)")
async def model_config(name: str, version: str | None = None, api: ApiContext = Depends(api_context)) -> Response:
    """The model's configuration in Triton's field names, as `tritonclient.get_model_config` expects."""
    api.engine.model(name, version)
    config = api.engine.config_of(name, version)

    def tensor(t) -> dict[str, Any]:  # noqa: ANN001
        return {"name": t.name, "data_type": "TYPE_STRING" if t.datatype == "BYTES" else f"TYPE_{t.datatype}", "dims": t.shape}

    kind = "KIND_GPU" if config.device.startswith("cuda") else "KIND_CPU"
    return _json({
        "name": config.name,
        "platform": PLATFORMS[config.runtime],
        "backend": config.runtime,
        "max_batch_size": config.max_batch_size,
        "input": [tensor(t) for t in config.inputs],
        "output": [tensor(t) for t in config.outputs],
        "instance_group": [{"count": config.instances, "kind": kind}],
        "dynamic_batching": {
            "policy": config.batching.policy,
            "max_queue_delay_microseconds": int(config.batching.max_wait_ms * 1000),
        },
        "servewell": config.model_dump(mode="json"),
    })


@router.post("/repository/index", summary="Repository index")
async def repository_index(api: ApiContext = Depends(api_context)) -> Response:
    """Every model of the repository with its state and, if not ready, the reason."""
    entries = []
    for view in api.engine.models():
        entry = {"name": view.name, "version": view.version, "state": TRITON_STATES.get(view.state, "UNAVAILABLE")}
        if view.reason:
            entry["reason"] = view.reason
        entries.append(entry)
    return _json(entries)


_INFER_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object", "description": "priority (1 = high lane), timeout (microseconds), binary_data_output"},
            "inputs": {"type": "array", "items": {"type": "object", "required": ["name", "shape", "datatype"]}},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        }}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                 "description": "JSON header + binary tensors (Inference-Header-Content-Length)"}},
    },
}


@router.post("/models/{name}/infer", summary="Inference", openapi_extra={"requestBody": _INFER_BODY})
@router.post("/models/{name}/versions/{version}/infer", summary="Inference (version)", openapi_extra={"requestBody": _INFER_BODY})
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    """Run the model on JSON (or binary-extension) tensors."""
    api = api_context(request)
    started = time.perf_counter()
    arrived_at = asyncio.get_running_loop().time()
    model_var.set(name)
    header_lane = "high" if request.headers.get("x-urgency", "").strip().lower() == "high" else None
    api.engine.admit(name, version, header_lane)  # 404/503 before reading and decoding the body
    check_content_type(request, ("application/json", "application/octet-stream"))
    body = await read_body(request, api.settings.max_body_bytes)
    preprocess_started = time.perf_counter()
    with stage_span(api, "preprocess", name):
        body = _decompress(body, request.headers.get("content-encoding"), api.settings.max_body_bytes)
        parsed = parse_infer_request(body, _header_length(request))
        config = api.engine.config_of(name, version)
        inputs = {}
        for tensor in parsed.inputs:
            inputs[tensor.name] = await _model_input(api, config, tensor)
    preprocess_s = time.perf_counter() - preprocess_started
    lane, timeout_ms = _scheduling(parsed.parameters, config.batching.lanes)
    if header_lane is not None:
        lane = config.batching.lanes[0]
    header_timeout = timeout_from_header(request)
    result = await unless_disconnected(request, api.engine.submit(
        name, version, inputs, lane=lane, timeout_ms=header_timeout if header_timeout is not None else timeout_ms,
        request_id=request_id_var.get(), arrived_at=arrived_at,
    ))
    post_started = time.perf_counter()
    outputs = result.outputs
    if parsed.requested_outputs is not None:
        unknown = [n for n in parsed.requested_outputs if n not in outputs]
        if unknown:
            raise InvalidInput(f"unknown output '{unknown[0]}'; model '{name}' has {list(outputs)}")
        outputs = {n: outputs[n] for n in parsed.requested_outputs}
    binary = set(outputs) if parsed.all_binary else parsed.binary_outputs
    body_out, json_length = encode_infer_response(name, config.version, parsed.id, outputs, binary)
    postprocess_s = time.perf_counter() - post_started
    api.record_stages(name, result, preprocess_s, postprocess_s)
    total_s = time.perf_counter() - started
    headers = {"Server-Timing": server_timing(result.queue_s, preprocess_s, result.compute_s, postprocess_s, total_s)}
    if json_length is None:
        return Response(body_out, 200, headers, "application/json")
    headers["Inference-Header-Content-Length"] = str(json_length)
    return Response(body_out, 200, headers, "application/octet-stream")


def _header_length(request: Request) -> int | None:
    raw = request.headers.get("inference-header-content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise BadRequest(f"Inference-Header-Content-Length must be a byte count, got {raw!r}")
    return int(raw)


def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    if not encoding or encoding.lower() == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise BadRequest(f"Content-Encoding '{encoding}' is not supported (gzip, deflate)")
    decompressor = zlib.decompressobj(wbits)
    try:
        out = decompressor.decompress(body, limit + 1)
    except zlib.error:
        raise BadRequest(f"body is not valid {encoding} data") from None
    if len(out) > limit or decompressor.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed body exceeds the limit of {limit} bytes")
    return out


def _scheduling(parameters: dict[str, Any], lanes: list[str]) -> tuple[str | None, float | None]:
    """Lane and deadline from OIP parameters. priority follows Triton: 0 is the default lane,
    1 the highest, 2 the next...; a lane name is accepted too. timeout is in microseconds, as
    Triton and tritonclient define it."""
    priority = parameters.get("priority", 0)
    if isinstance(priority, str) and priority in lanes:
        lane: str | None = priority
    elif isinstance(priority, int) and not isinstance(priority, bool) and priority >= 0:
        lane = lanes[min(priority, len(lanes)) - 1] if priority > 0 else None
    else:
        raise InvalidInput(f"parameters.priority must be 0..{len(lanes)} or one of {lanes}")
    timeout = parameters.get("timeout")
    if timeout is None:
        return lane, None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidInput("parameters.timeout must be a positive number of microseconds")
    return lane, timeout / 1000.0


async def _model_input(api: ApiContext, config: ModelConfig, tensor: DecodedTensor) -> np.ndarray:
    name, datatype, array = tensor.name, tensor.datatype, tensor.array
    spec = config.input_spec(name)
    if spec is None:
        raise InvalidInput(f"unknown input '{name}'; model '{config.name}' takes {[t.name for t in config.inputs]}")
    if datatype == "BYTES" and spec.datatype != "BYTES" and config.image_input == name:
        # Encoded images: raw bytes in the binary extension, base64 strings in JSON.
        blobs = list(array.reshape(-1))
        if not tensor.from_binary:
            blobs = [decode_base64(b.decode("ascii", "replace"), name) for b in blobs]
        if not blobs:
            raise InvalidInput(f"input '{name}' holds no images")
        return (await api.decode_images(config, blobs)).astype(spec.numpy_dtype, copy=False)
    if datatype != spec.datatype:
        raise InvalidInput(f"input '{name}' has datatype {datatype}, model '{config.name}' expects {spec.datatype}")
    return array
