"""The simple API: `POST /predict` with a base64 image, and `GET /healthz`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
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
from servewell.api.public_text import public_rollout, without_paths
from servewell.api.routes_pool import pool_fields, pool_report
from servewell.api.state import AppState, app_state, state_dependency
from servewell.config.model import ModelConfig
from servewell.engine.protocol import SchedulingFacts
from servewell.errors import BadRequest, InvalidInput, quote
from servewell.observability.context import request_id_var
from servewell.observability.payload_log import PayloadLog
from servewell.observability.process import rss_bytes

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


@router.post(
    PREDICT_PATH,
    response_model=PredictResponse,
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": PredictRequest.model_json_schema()}}},
                   "parameters": INFERENCE_HEADERS},
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
    model = await call.open(req.model or state.engine.default_model_name(), None, urgency or req.urgency)
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
    models = {}
    roots = (state.settings.model_repository, state.settings.cache_dir)  # open to anyone: no absolute paths
    for view in state.engine.models():
        models[view.name] = {
            "state": view.state,
            "ready": view.state == "ready",
            "version": view.version,
            "reason": without_paths(view.reason, roots),
            "last_failure": without_paths(view.last_failure, roots),
            "serving_dtype": view.serving_dtype,
            "queue_depth": view.queue_depth,
            "load_s": round(view.load_s, 3) if view.load_s is not None else None,
            "restarts": view.restarts,
            "recycles": view.recycles,
            "instances": [asdict(i) for i in view.instances],
            "rss_bytes": sum(i.rss_bytes for i in view.instances),
            "lanes": view.scheduling.lane_depths if view.scheduling else {},
            "max_batch_size": view.scheduling.max_batch_size if view.scheduling else None,
            "scheduler": _scheduler_counts(view.scheduling),
            **pool_fields(view),  # the model pool (engine/model_pool.py): where the model is
            "last_start": view.last_start,  # spawn, import, load, warm-up of its last worker start
            "versions": list(view.versions) or [view.version],
            "rollout": public_rollout(view.rollout, roots),  # full detail: GET /admin/models/{name}/rollout
        }
    readiness = state.engine.readiness()
    total, reserved = state.engine.memory_budget
    doc = {
        "status": readiness.status,
        "ready": readiness.ready,
        "readiness": {"policy": state.engine.readiness_policy, "reason": without_paths(readiness.reason, roots)},
        "frontend_rss_bytes": rss_bytes(),
        "memory_budget": {"total_bytes": total, "reserved_bytes": reserved},
        # The model pool: repository mode, host and device budgets and what loaded models reserve of
        # them, how many models are resident or loading (api/routes_pool.py).
        "pool": pool_report(state.engine),
        "models": models,
        "alerts": _active_alerts(state),
    }
    # A rejected config file is degraded configuration, not unreadiness: "ready" stays as it is.
    config = doc["config"] = state.config_status()
    if config["rejected"] and doc["status"] == "ok":
        doc["status"] = "degraded"
    payload_log = getattr(state.engine, "payload_log", None)  # the engine's (observability/payload_log.py)
    if isinstance(payload_log, PayloadLog):  # a failing sink (a full disk) loses records: degraded, still ready
        payload = doc["payload_log"] = payload_log.health()
        if payload["status"] == "failing" and doc["status"] == "ok":
            doc["status"] = "degraded"
    ready = readiness.ready
    return _json(doc, 200 if ready else 503, None if ready else {"Retry-After": "2"})


def _scheduler_counts(facts: SchedulingFacts | None) -> dict[str, int] | None:
    if facts is None:
        return None
    return {"batches": facts.batches, "rows": facts.rows, "expired": facts.expired, "cancelled": facts.cancelled,
            "rejected": facts.rejected, "isolated_batches": facts.isolated_batches}


def _active_alerts(state: AppState) -> list[dict[str, Any]]:
    # The server's own golden-signal alerts (observability/alerting.py): informative, they never
    # change readiness (a load balancer must not drain a slow server and overload the rest).
    return state.console.alerts.to_json()
