"""Streaming over the Open Inference Protocol's REST API (Triton's generate extension and
MLServer's stream endpoints), as server-sent events:

- `POST /v2/models/{name}/generate`: `{"text_input": "...", "parameters": {"max_tokens": 64}}` ->
  `{"model_name", "model_version", "text_output"}`, the whole answer at once;
- `POST /v2/models/{name}/generate_stream`: the same request; one event per part
  (`data: {"model_name", "model_version", "text_output": "<piece>"}`);
- `POST /v2/models/{name}/infer_stream`: an OIP infer request; one event per part, each an OIP infer
  response of that part's outputs (a model that is not generative answers in one part).

Every stream ends with one final event, `{"final": true, "finish_reason": "stop" | "length",
"parts": N, "server_timing": "..."}`, or, when an error ended it (mid-stream too),
`{"final": true, "error": {"code", "message", "request_id"}, ...}` with the stable error code.
A refusal before the first event (unknown model, full lane, bad body) is an ordinary JSON error
answer with its status. `/versions/{version}/` paths work too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from servewell.api.body import check_content_type, json_object, read_body
from servewell.api.codecs.tensors import parse_infer_request
from servewell.api.dataplane import InferenceCall
from servewell.api.http_request import timeout_ms_of, urgency_of
from servewell.api.model_document import timeout_us_of
from servewell.api.openapi import (
    INFER_REQUEST_BODY,
    INFERENCE_HEADERS,
    OIP_PARAMETERS,
    error_responses,
    event_stream_response,
    json_body,
)
from servewell.api.sse import EventStreamResponse, sse_event
from servewell.api.state import app_state
from servewell.api.stream_call import StreamCall, StreamEnd
from servewell.api.text_tensors import TextPieces, text_inputs, text_model
from servewell.config.tensors import NUMPY_TO_OIP
from servewell.errors import InvalidInput, ServeError, quote
from servewell.observability.context import request_id_var

router = APIRouter(prefix="/v2", tags=["Streaming"])

#: Largest `max_tokens` a request may ask for (the model's generate.max_outputs bounds it too).
MAX_TOKENS_LIMIT = 1_000_000


#: What /openapi.json says of `parameters.max_tokens` (and OpenAI's `max_tokens`).
MAX_TOKENS_SCHEMA: dict[str, Any] = {
    "type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_LIMIT,
    "description": "Most parts (tokens) of the answer; absent or null: the model's generate.max_outputs."}
#: Every error a streaming route answers before its first event (later ones end the stream).
STREAM_ERRORS = (400, 401, 404, 408, 413, 415, 422, 429, 503)
_GENERATE_EXTRA = {"parameters": INFERENCE_HEADERS, "requestBody": json_body({
    "title": "GenerateRequest", "type": "object", "required": ["text_input"],
    "properties": {
        "text_input": {"type": "string", "description": "The prompt."},
        "parameters": {"type": ["object", "null"], "properties": {**OIP_PARAMETERS, "max_tokens": MAX_TOKENS_SCHEMA}},
    }})}
_INFER_STREAM_SCHEMA = {**INFER_REQUEST_BODY["content"]["application/json"]["schema"], "title": "InferStreamRequest"}
_INFER_STREAM_SCHEMA["properties"] = {**_INFER_STREAM_SCHEMA["properties"], "parameters": {
    "type": "object", "properties": {**OIP_PARAMETERS, "max_tokens": MAX_TOKENS_SCHEMA}}}
_INFER_STREAM_EXTRA = {"parameters": INFERENCE_HEADERS, "requestBody": json_body(_INFER_STREAM_SCHEMA)}
_GENERATE_ANSWERS = {**error_responses(*STREAM_ERRORS, oip=True), 200: {
    "description": "The whole text: model_name, model_version, text_output, finish_reason.",
    "content": {"application/json": {"schema": {"type": "object"}}}}}
_STREAM_ANSWERS = {**error_responses(*STREAM_ERRORS, oip=True),
                   **event_stream_response("One event per part, then a final event (final: true).")}


def error_doc(error: ServeError) -> dict[str, Any]:
    """A stream's final event for `error`: the same fields as every error answer's body."""
    return {"code": error.code, "message": error.message, "request_id": request_id_var.get()}


def final_event(end: StreamEnd, extra: dict[str, Any] | None = None) -> bytes:
    """The last event of an OIP stream."""
    doc: dict[str, Any] = {**(extra or {}), "final": True, "finish_reason": end.finish_reason, "parts": end.parts,
                           "server_timing": end.server_timing}
    if end.error is not None:
        doc["error"] = error_doc(end.error)
    return sse_event(doc)


def max_tokens_of(value: object, field: str = "parameters.max_tokens") -> int:
    """A request's `max_tokens` (0: the model's own bound); `InvalidInput` naming `field`."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise InvalidInput(f"{field} must be a whole number from 1 to {MAX_TOKENS_LIMIT}, got {quote(value)}")
    return value


async def _generate_request(name: str, request: Request, version: str | None) -> tuple[InferenceCall, StreamCall,
                                                                                           str]:
    state = app_state(request)
    call = state.plane.call()
    model = await call.open(name, version, urgency_of(request))
    check_content_type(request, ("application/json",))
    with call.receiving():
        body = await read_body(request, state.settings.max_body_bytes)
    with call.preprocessing():
        doc = json_object(body)
        prompt = doc.get("text_input")
        if not isinstance(prompt, str):
            raise InvalidInput(f"text_input must be a string (the prompt), got {quote(prompt)}")
        _, output = text_model(model.config, "generate")
        if output is None:
            raise InvalidInput(f"model {quote(name)} answers no text (its text: section names no output)")
        parameters = doc.get("parameters")
        if parameters is None:
            parameters = {}
        elif not isinstance(parameters, dict):
            raise InvalidInput(f"parameters must be an object, got {quote(parameters)}")
        inputs = text_inputs(model.config, prompt)
    stream = StreamCall(call)
    header_timeout = timeout_ms_of(request)
    timeout_us = timeout_us_of(parameters.get("timeout"))
    stream.open(inputs, priority=parameters.get("priority"),
                timeout_ms=header_timeout if header_timeout is not None else
                (timeout_us / 1000.0 if timeout_us is not None else None),
                max_outputs=max_tokens_of(parameters.get("max_tokens")))
    return call, stream, output


@router.post("/models/{name}/generate", summary="Generate text (whole answer)", openapi_extra=_GENERATE_EXTRA,
             responses=_GENERATE_ANSWERS)
@router.post("/models/{name}/versions/{version}/generate", summary="Generate text from a version (whole answer)",
             openapi_extra=_GENERATE_EXTRA, responses=_GENERATE_ANSWERS)
async def generate(name: str, request: Request, version: str | None = None) -> Response:
    """The text a generative model makes for `text_input`, at once (Triton's generate extension)."""
    call, stream, output = await _generate_request(name, request, version)
    pieces = TextPieces(output)
    text = [pieces.piece(part.outputs) async for part in stream.parts()]
    end = stream.end
    assert end is not None
    if end.error is not None:
        raise end.error
    version_served = end.result.version if end.result is not None and end.result.version else \
        call.model.config.version
    doc = {"model_name": name, "model_version": version_served, "text_output": "".join(text) + pieces.rest(),
           "finish_reason": end.finish_reason}
    return Response(orjson.dumps(doc), 200, {"Server-Timing": end.server_timing, "X-Model-Version": version_served},
                    "application/json")


@router.post("/models/{name}/generate_stream", summary="Generate text as server-sent events",
             openapi_extra=_GENERATE_EXTRA, responses=_STREAM_ANSWERS)
@router.post("/models/{name}/versions/{version}/generate_stream", summary="Generate text from a version as events",
             openapi_extra=_GENERATE_EXTRA, responses=_STREAM_ANSWERS)
async def generate_stream(name: str, request: Request, version: str | None = None) -> Response:
    """Each piece of text as it is made, one server-sent event each, then a final event."""
    call, stream, output = await _generate_request(name, request, version)
    head = {"model_name": name, "model_version": call.model.config.version}

    async def events() -> AsyncIterator[bytes]:
        pieces = TextPieces(output)
        async for part in stream.parts():
            text = pieces.piece(part.outputs)
            if text:
                yield sse_event({**head, "text_output": text})
        rest = pieces.rest()
        if rest:
            yield sse_event({**head, "text_output": rest})
        assert stream.end is not None
        yield final_event(stream.end, head)

    return EventStreamResponse(events(), on_disconnect=stream.cancel)


@router.post("/models/{name}/infer_stream", summary="Infer as server-sent events",
             openapi_extra=_INFER_STREAM_EXTRA, responses=_STREAM_ANSWERS)
@router.post("/models/{name}/versions/{version}/infer_stream", summary="Infer on a version as server-sent events",
             openapi_extra=_INFER_STREAM_EXTRA, responses=_STREAM_ANSWERS)
async def infer_stream(name: str, request: Request, version: str | None = None) -> Response:
    """An OIP infer request whose answer comes as events: one OIP response per part, then a final event."""
    state = app_state(request)
    call = state.plane.call()
    model = await call.open(name, version, urgency_of(request))
    check_content_type(request, ("application/json",))
    with call.receiving():
        body = await read_body(request, state.settings.max_body_bytes)
    with call.preprocessing():
        parsed = parse_infer_request(body, None)
        inputs = await call.model_inputs(parsed.inputs, parsed.parameters.get("priority"))
    stream = StreamCall(call)
    header_timeout = timeout_ms_of(request)
    timeout_us = timeout_us_of(parsed.parameters.get("timeout"))
    stream.open(inputs, priority=parsed.parameters.get("priority"),
                timeout_ms=header_timeout if header_timeout is not None else
                (timeout_us / 1000.0 if timeout_us is not None else None),
                oip_id=parsed.id, max_outputs=max_tokens_of(parsed.parameters.get("max_tokens")))
    head: dict[str, Any] = {"model_name": name, "model_version": model.config.version}
    if parsed.id:
        head["id"] = parsed.id

    async def events() -> AsyncIterator[bytes]:
        async for part in stream.parts():
            yield sse_event({**head, "outputs": oip_outputs(part.outputs, parsed.requested_outputs)})
        assert stream.end is not None
        yield final_event(stream.end, head)

    return EventStreamResponse(events(), on_disconnect=stream.cancel)


def oip_outputs(outputs: dict[str, np.ndarray], requested: list[str] | None = None) -> list[dict[str, Any]]:
    """A part's outputs as OIP JSON tensors (the requested ones, when the request named some)."""
    names = requested if requested else list(outputs)
    return [{"name": name, "datatype": NUMPY_TO_OIP.get(outputs[name].dtype.name, "BYTES"),
             "shape": list(outputs[name].shape), "data": outputs[name].reshape(-1).tolist()}
            for name in names if name in outputs]
