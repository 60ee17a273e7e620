"""The simple API: `POST /predict` with a base64 image, and `GET /healthz`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servewell.api.body import check_content_type, read_body
from servewell.api.codecs.image import decode_base64
from servewell.api.context import (
    ApiContext,
    api_context,
    lane_from,
    server_timing,
    stage_span,
    timeout_from_header,
    unless_disconnected,
)
from servewell.config.model import ModelConfig
from servewell.errors import BadRequest, InvalidInput
from servewell.observability.context import model_var, request_id_var
from servewell.observability.process import rss_bytes

router = APIRouter()


class PredictRequest(BaseModel):
    """Body of `POST /predict`."""

    model_config = ConfigDict(extra="forbid")

    image_base64: str = Field(description="The image (PNG, JPEG, ...) encoded as base64.")
    urgency: Literal["normal", "high"] = Field("normal", description="high: skip the batching window, go first.")
    model: str | None = Field(None, description="Model to use; default: the server's default model (digits).")


class PredictResponse(BaseModel):
    """Answer of `POST /predict`."""

    result: dict[str, Any] = Field(description="label, index, score and top_k for classifiers; raw outputs otherwise.")
    request_id: str = Field(description="Id of this request (also in the X-Request-ID header).")


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, "application/json")


@router.post(
    "/predict",
    response_model=PredictResponse,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": PredictRequest.model_json_schema()}}}},
    summary="Classify one image",
)
async def predict(request: Request) -> Response:
    """Decode the image, run it through the model and return the label."""
    api = api_context(request)
    started = time.perf_counter()
    arrived_at = asyncio.get_running_loop().time()
    check_content_type(request, ("application/json",))
    body = await read_body(request, api.settings.max_body_bytes)
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    try:
        req = PredictRequest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(body)"
        raise InvalidInput(f"field '{where}': {err['msg']}") from None
    name = req.model or api.engine.default_model_name()
    model_var.set(name)
    config = api.engine.config_of(name)
    if config.image_input is None:
        raise InvalidInput(f"model '{name}' takes no images; call /v2/models/{name}/infer with tensors")
    lane = lane_from(request, req.urgency)
    api.engine.admit(name, None, lane)  # refuse before the image is decoded
    decode_started = time.perf_counter()
    with stage_span(api, "preprocess", name):
        image = decode_base64(req.image_base64, "image_base64")
        batch = await api.decode_images(config, [image])
    preprocess_s = time.perf_counter() - decode_started
    inputs = {config.image_input: batch.astype(config.input_spec(config.image_input).numpy_dtype, copy=False)}
    result = await unless_disconnected(request, api.engine.submit(
        name, None, inputs, lane=lane, timeout_ms=timeout_from_header(request), request_id=request_id_var.get(),
        arrived_at=arrived_at,
    ))
    post_started = time.perf_counter()
    body_out = orjson.dumps({"result": interpret(config, result.outputs), "request_id": request_id_var.get()})
    postprocess_s = time.perf_counter() - post_started
    api.record_stages(name, result, preprocess_s, postprocess_s)
    timing = server_timing(result.queue_s, preprocess_s, result.compute_s, postprocess_s, time.perf_counter() - started)
    return Response(body_out, 200, {"Server-Timing": timing}, "application/json")


def interpret(config: ModelConfig, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Turn one request's outputs into the `/predict` result."""
    post = config.postprocess
    if post is None:
        return {name: array[0].tolist() for name, array in outputs.items()}
    name = post.output or config.outputs[0].name
    scores = outputs[name][0].astype(np.float64).reshape(-1)
    if post.apply_softmax:
        shifted = np.exp(scores - scores.max())
        scores = shifted / shifted.sum()
    order = np.argsort(-scores)[: post.top_k]

    def label(i: int) -> str:
        return post.labels[i] if post.labels and i < len(post.labels) else str(i)

    top = [{"label": label(int(i)), "index": int(i), "score": round(float(scores[i]), 6)} for i in order]
    return {**top[0], "top_k": top}


@router.get("/healthz", summary="Server and per-model health")
async def healthz(api: ApiContext = Depends(api_context)) -> Response:
    """200 when every model is ready, 503 otherwise; always with per-model state and memory."""
    models = {}
    for view in api.engine.models():
        models[view.name] = {
            "state": view.state,
            "version": view.version,
            "reason": view.reason,
            "queue_depth": view.queue_depth,
            "load_s": round(view.load_s, 3) if view.load_s is not None else None,
            "restarts": view.restarts,
            "recycles": view.recycles,
            "instances": [
                {"instance": i.instance, "pid": i.pid, "alive": i.alive, "rss_bytes": i.rss_bytes,
                 "rows_computed": i.rows_computed}
                for i in view.instances
            ],
            "rss_bytes": sum(i.rss_bytes for i in view.instances),
            "lanes": view.lane_depths,
            "scheduler": asdict(view.stats) if view.stats else None,
        }
    ready = api.engine.ready
    doc = {
        "status": "ok" if ready else "not_ready",
        "ready": ready,
        "frontend_rss_bytes": rss_bytes(),
        "memory_budget": {"total_bytes": api.engine.budget.total_bytes, "reserved_bytes": api.engine.budget.used_bytes},
        "models": models,
    }
    return _json(doc, 200 if ready else 503, None if ready else {"Retry-After": "2"})
