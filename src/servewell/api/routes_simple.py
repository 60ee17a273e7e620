"""The simple API: `POST /predict` with a base64 image, and `GET /healthz`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servewell.api.body import check_content_type, read_body
from servewell.api.codecs.image import BASE64_PATTERN, decode_base64
from servewell.api.hot_routes import HotRoute
from servewell.api.http_request import disconnected, timeout_ms_of, urgency_of
from servewell.api.openapi import INFERENCE_HEADERS, error_responses, not_ready_response
from servewell.api.state import AppState, app_state, state_dependency
from servewell.config.model import ModelConfig
from servewell.engine.control import GetHealth
from servewell.errors import BadRequest, InvalidInput, quote
from servewell.observability.context import request_id_var

router = APIRouter()


class PredictRequest(BaseModel):
    """Body of `POST /predict`."""

    model_config = ConfigDict(extra="forbid")

    # The pattern is documented, not validated here: decode_base64 refuses bad base64 with a 400.
    image_base64: str = Field(min_length=1, json_schema_extra={"pattern": BASE64_PATTERN},
                              description="The image (PNG, JPEG, ...) encoded as base64 (a data: URL prefix is "
                              "allowed).")
    urgency: Literal["high", "normal", "low"] | None = Field(
        None, description="high: the model's first lane (skips the batching window, goes first); low: its last; "
        "default: its default lane. The X-Urgency header, when sent, wins.")
    model: str | None = Field(None, min_length=1, max_length=200,
                              description="Model to use; default: the server's default model.")


class PredictResponse(BaseModel):
    """Answer of `POST /predict`."""

    result: dict[str, Any] = Field(description="label, index, score and top_k for classifiers; raw outputs otherwise.")
    request_id: str = Field(description="Id of this request (also in the X-Request-ID header).")


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, "application/json")


PREDICT_PATH = "/predict"
#: `/predict?model=NAME`: the model named before the body, so that a full lane refuses the request
#: before its body is read (the body may then name no other model nor an urgency).
MODEL_PARAMETER = "model"


@router.post(
    PREDICT_PATH,
    response_model=PredictResponse,
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": PredictRequest.model_json_schema()}}},
                   "parameters": [*INFERENCE_HEADERS, {
                       "name": MODEL_PARAMETER, "in": "query", "required": False, "schema": {"type": "string"},
                       "description": "The model, named before the body: a request its lane would refuse is answered "
                                      "before its body is read. The body may then name no other model nor an urgency "
                                      "(X-Urgency chooses the lane)."}]},
    responses=error_responses(400, 401, 404, 408, 413, 415, 422, 429, 503),
    summary="Classify one image",
)
async def predict(request: Request) -> Response:
    """Decode the image, run it through the model and return the label."""
    state = app_state(request)
    call = state.plane.call()
    check_content_type(request, ("application/json",))
    urgency = urgency_of(request)
    state.plane.check_decode(urgency == "high")  # a full decode queue refuses before the body is read
    named = request.query_params.get(MODEL_PARAMETER)
    # A model named in the URL is admitted before the body is read (a full lane refuses at once).
    model = await call.open(named, None, urgency) if named else None
    body = await read_body(request, state.settings.max_body_bytes)
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    try:
        req = PredictRequest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(body)"
        raise InvalidInput(f"field {quote(where)}: {err['msg']}") from None
    if model is None:
        model = await call.open(req.model or state.engine.default_model_name(), None, urgency or req.urgency)
    elif (req.model and req.model != named) or (req.urgency and not urgency):
        raise InvalidInput(f"the URL names model {quote(named)}: the body may not name "
                           + (f"another ({quote(req.model)})" if req.model and req.model != named
                              else "an urgency (send X-Urgency)"))
    config = model.config
    if config.image_input is None:
        raise InvalidInput(f"model '{model.name}' takes no images; call /v2/models/{model.name}/infer with tensors")
    with call.preprocessing():
        batch = await call.decode_images([decode_base64(req.image_base64, "image_base64")])
    result = await call.infer({config.image_input: batch}, timeout_ms=timeout_ms_of(request),
                              disconnected=disconnected(request))
    with call.postprocessing():
        body_out = orjson.dumps({"result": interpret(config, result.outputs), "request_id": request_id_var.get()})
    return Response(body_out, 200, {"Server-Timing": call.finish(result),
                                    "X-Model-Version": result.version or config.version}, "application/json")


def hot_routes() -> list[HotRoute]:
    """`predict` for the dispatcher that runs it without FastAPI's routing (api/hot_routes.py)."""

    async def endpoint(request: Request, params: Mapping[str, str]) -> Response:
        return await predict(request)

    return [HotRoute("POST", PREDICT_PATH, endpoint)]


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


@router.get("/healthz", summary="Server and per-model health",
            responses=not_ready_response("The server is not ready (same document, ready: false)."))
async def healthz(state: AppState = Depends(state_dependency)) -> Response:
    """200 when the server is ready (by its readiness policy), 503 otherwise; always with the reason,
    per-model state and readiness, the last worker failure, and memory."""
    report = await state.control.run(GetHealth())  # built where the engine runs: api/health_document.py
    ready = report.ready
    return _json(report.document, 200 if ready else 503, None if ready else {"Retry-After": "2"})
