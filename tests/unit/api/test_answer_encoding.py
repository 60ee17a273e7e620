"""A large answer is encoded in bounded steps with the event loop running between them, and sent as
its parts (issue 45 H1: a 60 MB answer's JSON encoding held an ingress's loop for a second)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
from starlette.types import Message

from servewell.api.codecs.image import ImageLimits
from servewell.api.codecs.tensors import STEP_VALUES, encode_infer_response, infer_response_steps, run_steps
from servewell.api.dataplane import ENCODE_IN_STEPS_BYTES, DataPlane
from servewell.api.decode_scheduler import DecodeScheduler
from servewell.api.grpc.codec import encode_response, response_steps
from servewell.api.response_writes import PartsResponse, parts_response
from servewell.observability.tracing import Tracing, TracingSettings


def test_a_large_json_tensor_is_encoded_in_steps_of_bounded_size_into_the_same_document() -> None:
    values = np.arange(3 * STEP_VALUES + 5, dtype=np.float32)
    steps = infer_response_steps("m", "1", "abc", {"y": values}, set())
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            body = done.value
            break
    assert yields == 3  # one step per STEP_VALUES values: the loop gets a turn between them
    doc = orjson.loads(body.joined())
    assert doc == {"model_name": "m", "model_version": "1", "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [values.size], "data": values.tolist()}], "id": "abc"}
    assert body.json_length is None and body.size == len(body.joined())


def test_a_binary_tensor_is_sent_from_its_own_memory_without_a_copy() -> None:
    values = np.arange(100_000, dtype=np.float32)
    body = run_steps(infer_response_steps("m", "1", None, {"y": values}, {"y"}))
    header, blob = body.parts
    assert body.json_length == len(header)
    assert np.shares_memory(np.frombuffer(blob, np.float32), values)  # a view: never joined into a copy
    raw, length = encode_infer_response("m", "1", None, {"y": values}, {"y"})
    assert b"".join(body.parts) == raw and length == body.json_length


def test_the_event_loop_runs_other_work_between_the_steps_of_a_large_answer() -> None:
    values = np.ones(ENCODE_IN_STEPS_BYTES // 4 * 2, dtype=np.float32)  # 2 MiB: encoded in steps
    ran_meanwhile: list[int] = []

    async def main() -> bytes:
        with ThreadPoolExecutor(1) as pool:
            plane = DataPlane(None, DecodeScheduler(pool, 1, 1), ImageLimits(1), None,  # type: ignore[arg-type]
                              Tracing(TracingSettings(None, "grpc", 0.0)))
            call = plane.call()

            async def other_request() -> None:
                for turn in range(3):
                    ran_meanwhile.append(turn)
                    await asyncio.sleep(0)

            other = asyncio.ensure_future(other_request())
            body = await call.encode({"y": values}, infer_response_steps("m", "1", None, {"y": values}, set()))
            done_before = other.done()
            await other
            assert done_before, "the other request waited for the whole encoding"
            assert call.postprocess_s > 0
            return body.joined()

    text = asyncio.run(main())
    assert orjson.loads(text)["outputs"][0]["data"][:3] == [1.0, 1.0, 1.0]
    assert ran_meanwhile == [0, 1, 2]


def test_grpc_outputs_are_encoded_one_per_step_into_the_same_message() -> None:
    outputs = {"a": np.arange(4, dtype=np.int32), "b": np.ones((2, 2), np.float32)}
    steps = response_steps("m", "1", "id", outputs)
    next(steps)  # after the first output
    assert run_steps(steps).SerializeToString() == encode_response("m", "1", "id", outputs).SerializeToString()


def test_a_parts_response_sends_each_part_under_one_content_length() -> None:
    blob = memoryview(np.arange(10, dtype=np.uint8).data)
    response = parts_response([b'{"a":1}', blob], 200, {"X-Test": "1"}, "application/octet-stream")
    assert isinstance(response, PartsResponse)
    assert response.headers["content-length"] == str(7 + 10)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    scope: dict[str, Any] = {"type": "http"}
    asyncio.run(response(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert [(bytes(m["body"]), m["more_body"]) for m in sent[1:]] == [(b'{"a":1}', True), (bytes(range(10)), False)]
    assert not isinstance(parts_response([b"x"], 200, {}, "application/json"), PartsResponse)  # one part: plain
