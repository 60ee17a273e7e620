"""gRPC `ModelStreamInfer` (Triton's bidirectional stream, as `tritonclient.grpc`'s `start_stream` and
`async_stream_infer` use it): the client writes `ModelInferRequest`s on one call whenever it likes,
and each is a stream of its own (api/stream_call.py: the same admission, deadlines, lanes and
tenants as every request) whose parts come back as `ModelStreamInferResponse`s carrying the
request's `id`, as they are made. A model that is not generative answers in one response.

Errors, mid-stream too, are a response with `error_message` "[code] message" (the stable servewell
code first; tritonclient hands it to the callback as an `InferenceServerException`). A request with
`triton_enable_empty_final_response` (tritonclient's `enable_empty_final_response=True`) ends with
an empty response whose parameters say `triton_final_response` true, `finish_reason` and
`server_timing`. The call's key is checked once, when it opens; a client that cancels the call
frees every sequence it had at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from tritonclient.grpc import service_pb2 as pb

from servewell.api.dataplane import DataPlane
from servewell.api.grpc.codec import decode_request, metadata_value, parameter_value, response_steps
from servewell.api.grpc.scope import RpcContext, RpcScope
from servewell.api.routes_stream import max_tokens_of
from servewell.api.stream_call import StreamCall, StreamEnd
from servewell.errors import InvalidInput, ServeError

#: Requests of one call whose streams run at once; more are answered with an error response.
MAX_STREAMS_PER_CALL = 256
#: Responses waiting to be written on one call before its streams wait for the client to read.
WRITE_QUEUE = 1024
FINAL_FLAG = "triton_enable_empty_final_response"


async def model_stream_infer(plane: DataPlane, scope: RpcScope, context: RpcContext) -> None:
    """Serve one `ModelStreamInfer` call (inside `scope.run`: key, request id, metrics, errors)."""

    async def handle(_: None) -> None:
        await _serve_call(plane, context)

    await scope.run("ModelStreamInfer", context, None, handle)


async def _serve_call(plane: DataPlane, context: RpcContext) -> None:
    replies: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(WRITE_QUEUE)
    streams: set[asyncio.Task[None]] = set()
    urgency = metadata_value(context.invocation_metadata(), "x-urgency")

    async def writer() -> None:
        while (reply := await replies.get()) is not None:
            await context.write(reply)

    writing = asyncio.ensure_future(writer())
    try:
        while True:
            data = await context.read()
            if not isinstance(data, bytes):
                break  # the client closed its side: finish the streams it opened
            try:
                request = pb.ModelInferRequest.FromString(data)
            except DecodeError:
                await replies.put(_error("", InvalidInput("a message is not a valid inference.ModelInferRequest")))
                continue
            if len(streams) >= MAX_STREAMS_PER_CALL:
                await replies.put(_error(request.id, InvalidInput(
                    f"{MAX_STREAMS_PER_CALL} requests of this call are still streaming; wait for one to end")))
                continue
            task = asyncio.ensure_future(_one_stream(plane, context, request, urgency, replies))
            streams.add(task)
            task.add_done_callback(streams.discard)
        if streams:
            await asyncio.gather(*streams, return_exceptions=True)
        await replies.put(None)
        await writing
    finally:
        for task in list(streams):
            task.cancel()  # the call ended (cancelled): each stream's sequence is freed at the next step
        writing.cancel()
        with contextlib.suppress(BaseException):
            await writing


async def _one_stream(plane: DataPlane, context: RpcContext, request: pb.ModelInferRequest, urgency: str | None,
                      replies: asyncio.Queue[pb.ModelStreamInferResponse | None]) -> None:
    stream: StreamCall | None = None
    final = FINAL_FLAG in request.parameters and bool(parameter_value(request.parameters[FINAL_FLAG]))
    try:
        call = plane.call()
        model = await call.open(request.model_name, request.model_version or None, urgency)
        with call.preprocessing():
            decoded = decode_request(request)
            inputs = await call.model_inputs(decoded.inputs)
        max_tokens = parameter_value(request.parameters["max_tokens"]) if "max_tokens" in request.parameters else None
        timeout_ms = decoded.timeout_us / 1000.0 if decoded.timeout_us is not None else None
        remaining_s = context.time_remaining()
        not_after = asyncio.get_running_loop().time() + remaining_s if remaining_s is not None else None
        stream = StreamCall(call)
        stream.open(inputs, priority=decoded.priority, timeout_ms=timeout_ms, not_after=not_after,
                    oip_id=request.id or None, max_outputs=max_tokens_of(max_tokens))
        version = model.config.version
        async for part in stream.parts():
            outputs = part.outputs if decoded.requested_outputs is None else \
                {name: part.outputs[name] for name in decoded.requested_outputs if name in part.outputs}
            response = await call.encode(outputs, response_steps(model.name, version, request.id, outputs))
            await replies.put(pb.ModelStreamInferResponse(infer_response=response))
        end = stream.end
        assert end is not None
        if end.error is not None:
            await replies.put(_error(request.id, end.error))
        elif final:
            await replies.put(_final(model.name, version, request.id, end))
    except ServeError as error:
        await replies.put(_error(request.id, error))
    except asyncio.CancelledError:
        if stream is not None:
            stream.cancel()
        raise


def _error(request_id: str, error: ServeError) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(error_message=f"[{error.code}] {error.message}",
                                       infer_response=pb.ModelInferResponse(id=request_id))


def _final(model: str, version: str, request_id: str, end: StreamEnd) -> pb.ModelStreamInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    response.parameters["triton_final_response"].bool_param = True
    response.parameters["finish_reason"].string_param = end.finish_reason
    response.parameters["server_timing"].string_param = end.server_timing
    return pb.ModelStreamInferResponse(infer_response=response)
