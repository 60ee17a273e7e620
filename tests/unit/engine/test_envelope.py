"""Frames between an ingress and the engine: what one side writes in a loop step arrives whole,
in order, however the bytes are split, and a broken peer only loses its connection."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import numpy as np
import pytest

from inference_requests import request_of
from servewell.engine.envelope import MAX_FRAME_BYTES, Cancel, Envelope, FrameReader, FrameWriter, Outcome, encode_frame
from servewell.engine.protocol import RequestResult, StepTiming
from servewell.errors import Overloaded


class _Sink:
    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.lost: list[BaseException | None] = []

    def reader(self) -> FrameReader:
        return FrameReader(self.messages.append, self.lost.append, lambda transport: None)


def test_frames_split_at_every_byte_arrive_whole_and_in_order() -> None:
    frames = encode_frame([Cancel(1), Cancel(2)]) + encode_frame([Cancel(3)])
    sink = _Sink()
    reader = sink.reader()
    for i in range(len(frames)):
        reader.data_received(frames[i:i + 1])
    assert sink.messages == [Cancel(1), Cancel(2), Cancel(3)]
    assert sink.lost == []


def test_an_envelope_and_its_outcome_keep_tensors_errors_and_retry_after() -> None:
    inputs = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    envelope = Envelope(7, request_of(inputs, lane=1, deadline_at=12.5, arrived_at=12.0, tenant="acme",
                                      request_id="rid"))
    refused = Outcome(8, error=Overloaded("lane full", retry_after_s=3.0))
    served = Outcome(9, result=RequestResult({"y": np.ones((3, 2), np.float32)}, 0.001, 0.002, 3))
    sink = _Sink()
    sink.reader().data_received(encode_frame([envelope, refused, served]))
    got_envelope, got_refused, got_served = sink.messages
    assert got_envelope.request.deadline_at == 12.5 and got_envelope.request.tenant == "acme"
    np.testing.assert_array_equal(got_envelope.request.inputs["x"], inputs["x"])
    assert isinstance(got_refused.error, Overloaded)
    assert got_refused.error.retry_after_s == 3.0 and got_refused.error.code == "overloaded"
    assert got_served.result.batch_size == 3
    np.testing.assert_array_equal(got_served.result.outputs["y"], np.ones((3, 2), np.float32))


def test_a_pipeline_answer_keeps_every_field_and_step_across_the_door() -> None:
    steps = (StepTiming("pre", "pre_model", 0.001, 0.002, 0.004, 2, "success"),
             StepTiming("post", "post_model", 0.0, 0.0, 0.0, 0, "skipped"))
    result = RequestResult({"p": np.full((1, 3), 0.5, np.float32)}, 0.001, 0.002, 2, cache="hit", steps=steps,
                           version="7")
    sink = _Sink()
    sink.reader().data_received(encode_frame([Outcome(3, result=result)]))
    (got,) = sink.messages
    assert got.result.steps == steps
    assert (got.result.queue_s, got.result.compute_s, got.result.batch_size, got.result.cache, got.result.version) == \
        (0.001, 0.002, 2, "hit", "7")
    np.testing.assert_array_equal(got.result.outputs["p"], result.outputs["p"])


def test_a_length_over_the_bound_drops_the_connection_not_the_process() -> None:
    sink = _Sink()
    reader = sink.reader()
    reader.data_received(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 8)
    assert sink.messages == [] and len(sink.lost) == 1 and "bound" in str(sink.lost[0])


def test_garbage_drops_the_connection() -> None:
    sink = _Sink()
    sink.reader().data_received(struct.pack(">I", 4) + b"\x00\x01\x02\x03")
    assert sink.messages == [] and len(sink.lost) == 1


def test_messages_written_in_one_loop_step_leave_as_one_frame() -> None:
    async def scenario() -> bytes:
        left, right = socket.socketpair()
        right.setblocking(False)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=left)
        writer = FrameWriter(transport)
        for call_id in range(100):
            writer.send(Cancel(call_id))
        expected = len(encode_frame([Cancel(i) for i in range(100)]))
        received = b""
        while len(received) < expected:
            received += await loop.sock_recv(right, 1 << 16)
        transport.close()
        right.close()
        return received

    received = asyncio.run(scenario())
    assert received == encode_frame([Cancel(i) for i in range(100)])  # one length prefix, all 100 inside


@pytest.mark.parametrize("count", [1, 1000])
def test_one_frame_costs_one_length_prefix(count: int) -> None:
    frame = encode_frame([Cancel(i) for i in range(count)])
    (length,) = struct.unpack_from(">I", frame)
    assert length == len(frame) - 4


def test_a_table_change_replaces_changed_models_drops_removed_ones_and_keeps_the_rest() -> None:
    from servewell.engine.envelope import ModelEntrySummary, ModelTable
    from servewell.engine.protocol import Readiness

    def entry(name: str, state: str) -> ModelEntrySummary:
        return ModelEntrySummary(name, "1", state, None, None)

    ready = Readiness(True, "ok")
    full = ModelTable({"a": entry("a", "ready"), "b": entry("b", "unloaded"), "c": entry("c", "ready")}, "a",
                      ready, True)
    change = ModelTable({"b": entry("b", "loading")}, "a", Readiness(False, "b loading"), True, complete=False,
                        removed=("c",))
    merged = full.merged(change)
    assert merged.complete
    assert {n: e.state for n, e in merged.models.items()} == {"a": "ready", "b": "loading"}
    assert merged.readiness == Readiness(False, "b loading")
    assert full.merged(merged) is merged  # a complete table replaces whatever was there
