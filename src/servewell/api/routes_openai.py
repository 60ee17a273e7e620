"""The OpenAI-compatible API, for text-generation and embedding models (a `text:` section in
model.yaml): `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streamed with
`"stream": true`, else whole) and `POST /v1/embeddings`. The official `openai` client works with
`base_url="http://HOST:PORT/v1"` and a servewell API key as its `api_key`.

Each request is an ordinary servewell request: the same keys and tenants (`Authorization: Bearer`),
the same quotas, lanes (`X-Urgency`), deadlines (`X-Request-Timeout-Ms`), admission, payload log and
metrics as `/v2`, through the same stream (api/stream_call.py). What is specific here is the wire
format only:

- a chat's messages become one prompt, a line `role: content` per message and `assistant: ` last;
- `max_tokens` (or `max_completion_tokens`) bounds the parts (tokens) of the answer; sampling
  parameters (`temperature`, `top_p`, `seed`, ...) are accepted and left to the model (the example
  model decodes greedily); `n` above 1, a list of several prompts and tools are refused 422,
  naming the field;
- a stream's chunks follow OpenAI's (`chat.completion.chunk`, `text_completion`), its last chunk
  carries `finish_reason` and servewell's `server_timing`, then `data: [DONE]`; an error
  mid-stream is a chunk `{"error": {"code", "message", "request_id"}}` (the client raises it).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from servewell.api.body import check_content_type, json_object, read_body
from servewell.api.dataplane import InferenceCall
from servewell.api.http_request import disconnected, timeout_ms_of, urgency_of
from servewell.api.openapi import INFERENCE_HEADERS, error_responses, event_stream_response, json_body
from servewell.api.routes_stream import MAX_TOKENS_SCHEMA, STREAM_ERRORS, error_doc, max_tokens_of
from servewell.api.sse import EventStreamResponse, sse_event
from servewell.api.state import AppState, app_state
from servewell.api.stream_call import StreamCall
from servewell.api.text_tensors import TextPieces, text_inputs, text_model
from servewell.engine.control import ListModels
from servewell.errors import InvalidInput, quote
from servewell.observability.context import request_id_var

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

#: Most strings one embeddings request may carry (each is one request to the model).
MAX_EMBEDDING_INPUTS = 256
#: Most messages in one chat request.
MAX_MESSAGES = 1024
ROLES = ("system", "user", "assistant", "tool", "developer")

#: The request fields every generating route shares (sampling parameters are accepted, not listed).
_GENERATION_FIELDS: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "A model GET /v1/models lists."},
    "max_tokens": MAX_TOKENS_SCHEMA, "max_completion_tokens": MAX_TOKENS_SCHEMA,
    "stream": {"type": ["boolean", "null"], "description": "true: server-sent events, ended by data: [DONE]."},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1, "description": "Choices: one per request."},
}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_COMPLETIONS_EXTRA = {"parameters": INFERENCE_HEADERS, "requestBody": json_body({
    "title": "CompletionRequest", "type": "object", "required": ["model", "prompt"],
    "properties": {**_GENERATION_FIELDS, "prompt": {"anyOf": [
        {"type": "string"}, {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}}]}}})}
_CHAT_EXTRA = {"parameters": INFERENCE_HEADERS, "requestBody": json_body({
    "title": "ChatCompletionRequest", "type": "object", "required": ["model", "messages"],
    "properties": {**_GENERATION_FIELDS,
                   "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": {
                       "type": "object", "required": ["role", "content"], "properties": {
                           "role": {"type": "string", "enum": list(ROLES)},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}},
                   "tools": {"type": ["array", "null"], "maxItems": 0,
                             "description": "Not supported: absent, null or empty."}}})}
_EMBEDDINGS_EXTRA = {"parameters": INFERENCE_HEADERS, "requestBody": json_body({
    "title": "EmbeddingRequest", "type": "object", "required": ["model", "input"],
    "properties": {"model": _GENERATION_FIELDS["model"],
                   "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                            "maxItems": MAX_EMBEDDING_INPUTS,
                                                            "items": {"type": "string"}}]},
                   "encoding_format": {"type": ["string", "null"], "enum": ["float", "base64", None]}}})}
_GENERATE_ANSWERS = {**error_responses(*STREAM_ERRORS), **event_stream_response(
    "The completion as one JSON document, or (stream: true) as chunks, ended by data: [DONE].", json_too=True)}
_EMBEDDINGS_ANSWERS = {**error_responses(*STREAM_ERRORS), 200: {
    "description": "One embedding per input string.", "content": {"application/json": {"schema": {"type": "object"}}}}}


def _json(doc: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc), 200, headers, "application/json")


async def _body(request: Request, state: AppState) -> dict[str, Any]:
    check_content_type(request, ("application/json",))
    return json_object(await read_body(request, state.settings.max_body_bytes))


def _model_name(doc: dict[str, Any]) -> str:
    name = doc.get("model")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"model must be the name of a model (GET /v1/models lists them), got {quote(name)}")
    return name


def _flag(doc: dict[str, Any], field: str) -> bool:
    value = doc.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"{field} must be true or false, got {quote(value)}")
    return value


def _max_tokens(doc: dict[str, Any]) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        if doc.get(field) is not None:
            return max_tokens_of(doc[field], field)
    return 0


def _one_choice(doc: dict[str, Any]) -> None:
    n = doc.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidInput(f"n must be 1 (one choice per request), got {quote(n)}")


def _prompt(doc: dict[str, Any]) -> str:
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidInput(f"prompt must be a string (or a list of one string), got {quote(prompt)}")
    return prompt


def _chat_prompt(doc: dict[str, Any]) -> str:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput(f"messages must be a non-empty list of {{role, content}}, got {quote(messages)}")
    if len(messages) > MAX_MESSAGES:
        raise InvalidInput(f"messages holds {len(messages)} messages; at most {MAX_MESSAGES}")
    if doc.get("tools") not in (None, []):
        raise InvalidInput("tools are not supported by this server's models")
    lines = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidInput(f"messages[{index}] must be an object with role and content, got {quote(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidInput(f"messages[{index}].role must be one of {list(ROLES)}, got {quote(role)}")
        if isinstance(content, list):  # content parts: the text ones
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InvalidInput(f"messages[{index}].content parts must be of type text")
            content = "".join(texts)  # type: ignore[arg-type]  # checked: every part is a str
        if not isinstance(content, str):
            raise InvalidInput(f"messages[{index}].content must be a string, got {quote(content)}")
        lines.append(f"{role}: {content}\n")
    return "".join(lines) + "assistant: "


async def _open_text(request: Request, kind: str) -> tuple[AppState, InferenceCall, dict[str, Any]]:
    state = app_state(request)
    call = state.plane.call()
    doc = await _body(request, state)  # the model is named in the body: read (bounded) before it resolves
    await call.open(_model_name(doc), None, urgency_of(request))
    return state, call, doc


def _usage(prompt: str, parts: int) -> dict[str, int]:
    prompt_tokens = len(prompt.encode("utf-8"))  # the example models' tokens are bytes
    return {"prompt_tokens": prompt_tokens, "completion_tokens": parts, "total_tokens": prompt_tokens + parts}


@router.get("/models", summary="Models (OpenAI-compatible)")
async def list_models(request: Request) -> Response:
    """The models that take text (a `text:` section), as OpenAI lists models."""
    state = app_state(request)
    data = [{"id": view.name, "object": "model", "created": 0, "owned_by": "servewell"}
            for view in await state.control.run(ListModels())
            if view.config is not None and view.config.text is not None]
    return _json({"object": "list", "data": data})


@router.post("/completions", summary="Completions (OpenAI-compatible)", openapi_extra=_COMPLETIONS_EXTRA,
             responses=_GENERATE_ANSWERS)
async def completions(request: Request) -> Response:
    """Text completion of `prompt` by a generative model; streamed with `stream: true`."""
    _, call, doc = await _open_text(request, "completions")
    with call.preprocessing():
        _one_choice(doc)
        prompt = _prompt(doc)
        stream_wanted = _flag(doc, "stream")
    return await _generate(request, call, doc, prompt, chat=False, stream_wanted=stream_wanted)


@router.post("/chat/completions", summary="Chat completions (OpenAI-compatible)", openapi_extra=_CHAT_EXTRA,
             responses=_GENERATE_ANSWERS)
async def chat_completions(request: Request) -> Response:
    """A chat's next assistant message by a generative model; streamed with `stream: true`."""
    _, call, doc = await _open_text(request, "chat completions")
    with call.preprocessing():
        _one_choice(doc)
        prompt = _chat_prompt(doc)
        stream_wanted = _flag(doc, "stream")
    return await _generate(request, call, doc, prompt, chat=True, stream_wanted=stream_wanted)


async def _generate(request: Request, call: InferenceCall, doc: dict[str, Any], prompt: str, *, chat: bool,
                    stream_wanted: bool) -> Response:
    config = call.model.config
    _, output = text_model(config, "chat completions" if chat else "completions")
    if output is None:
        raise InvalidInput(f"model {quote(config.name)} answers no text (an embedding model: use /v1/embeddings)")
    with call.preprocessing():
        inputs = text_inputs(config, prompt)
    stream = StreamCall(call)
    stream.open(inputs, timeout_ms=timeout_ms_of(request), max_outputs=_max_tokens(doc))
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{request_id_var.get()}"
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    name = config.name
    pieces = TextPieces(output)

    def choice(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    if not stream_wanted:
        watcher = asyncio.ensure_future(disconnected(request))
        watcher.add_done_callback(lambda w: None if w.cancelled() else stream.cancel())
        try:
            text = "".join([pieces.piece(part.outputs) async for part in stream.parts()]) + pieces.rest()
        finally:
            watcher.cancel()
        end = stream.end
        assert end is not None
        if end.error is not None:
            raise end.error
        finish = "length" if end.finish_reason == "length" else "stop"
        answer = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None} if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return _json({"id": ident, "object": kind, "created": created, "model": name, "choices": [answer],
                      "usage": _usage(prompt, end.parts), "server_timing": end.server_timing},
                     {"Server-Timing": end.server_timing})

    async def events() -> AsyncIterator[bytes]:
        head = {"id": ident, "object": chunk_kind, "created": created, "model": name}
        first = True
        async for part in stream.parts():
            text = pieces.piece(part.outputs)
            if text or (first and chat):
                yield sse_event({**head, "choices": [choice(text, None, first)]})
                first = False
        end = stream.end
        assert end is not None
        if end.error is not None:
            yield sse_event({**head, "error": error_doc(end.error), "server_timing": end.server_timing})
        else:
            finish = "length" if end.finish_reason == "length" else "stop"
            yield sse_event({**head, "choices": [choice(pieces.rest(), finish, first)],
                             "usage": _usage(prompt, end.parts), "server_timing": end.server_timing})
        yield sse_event("[DONE]")

    return EventStreamResponse(events(), on_disconnect=stream.cancel)


@router.post("/embeddings", summary="Embeddings (OpenAI-compatible)", openapi_extra=_EMBEDDINGS_EXTRA,
             responses=_EMBEDDINGS_ANSWERS)
async def embeddings(request: Request) -> Response:
    """Embedding vectors of one string or a list of strings, by an embedding model (a `text:`
    section with no output: its first FP32 output is the embedding)."""
    _, call, doc = await _open_text(request, "embeddings")
    config = call.model.config
    with call.preprocessing():
        text_model(config, "embeddings")
        if config.text is not None and config.text.output is not None:
            raise InvalidInput(f"model {quote(config.name)} is a generative model; embeddings need an embedding "
                               "model (a text: section with no output)")
        raw = doc.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidInput(f"input must be a string or a non-empty list of strings, got {quote(raw)}")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise InvalidInput(f"input holds {len(texts)} strings; at most {MAX_EMBEDDING_INPUTS} per request")
        encoding = doc.get("encoding_format")
        encoding = "float" if encoding is None else encoding
        if encoding not in ("float", "base64"):
            raise InvalidInput(f"encoding_format must be 'float' or 'base64', got {quote(encoding)}")
        output = next((spec.name for spec in config.outputs if spec.datatype == "FP32"), None)
        if output is None:
            raise InvalidInput(f"model {quote(config.name)} has no FP32 output to answer as the embedding")
        requests = [text_inputs(config, text) for text in texts]
    timeout = timeout_ms_of(request)
    results = await asyncio.gather(*(call.infer(inputs, timeout_ms=timeout) for inputs in requests))
    vectors = [np.asarray(result.outputs[output], dtype="<f4").reshape(-1) for result in results]
    data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(vector.tobytes()).decode()
             if encoding == "base64" else vector.tolist()} for i, vector in enumerate(vectors)]
    tokens = sum(len(text.encode("utf-8")) for text in texts)
    return _json({"object": "list", "data": data, "model": config.name,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
