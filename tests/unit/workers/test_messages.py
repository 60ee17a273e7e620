"""The frames between the engine and a worker: the batch messages marshalled, every other message
pickled, each decoded back to an equal message, and a frame this server did not make refused."""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest

from servewell.workers import process_main
from servewell.workers.messages import (
    BatchDone,
    BatchFailed,
    LoadProgress,
    RunBatch,
    SequencePart,
    Shutdown,
    StepDone,
    TensorRef,
    decode_message,
    encode_message,
    receive_message,
    send_message,
)

REFS = (TensorRef("x", "<f4", (2, 64), 0, 512), TensorRef("mask", "|b1", (2,), 512, 2))


@pytest.mark.parametrize("message", [
    RunBatch(7, "sw-1-in-0", REFS, "00-" + "a" * 32 + "-" + "b" * 16 + "-01", (1, 1), (12.5, 13.25)),
    RunBatch(8, "sw-1-in-0", REFS),
    BatchDone(7, "sw-1-in-0-out0", REFS, 0.00125, 123 << 20, 4096, (("preprocess", 0.001),), 16, (1,)),
    BatchDone(9, "seg", (), 0.0, 0, 1),
])
def test_batch_messages_are_marshalled_and_come_back_equal(message: RunBatch | BatchDone) -> None:
    frame = encode_message(message)
    assert frame[:1] in (b"M", b"D")
    assert decode_message(frame) == message


def test_a_step_is_marshalled_with_its_parts_arrays_and_comes_back_equal() -> None:
    text = np.frombuffer(b"ab", dtype=np.uint8)[None, :]
    step_id: Any = np.int64(4)  # numpy numbers arrive as plain ones
    parts = (SequencePart(1, {"text_output": text, "logit": np.array([[0.5]], np.float32)}),
             SequencePart(2, None, True), SequencePart(3, None, True, "boom"))
    message = StepDone(step_id, parts, float(np.float64(0.002)), 10 << 20)
    frame = encode_message(message)
    assert frame[:1] == b"S"
    decoded = decode_message(frame)
    assert isinstance(decoded, StepDone) and type(decoded.step_id) is int
    assert (decoded.step_id, decoded.compute_s, decoded.rss_bytes) == (4, 0.002, 10 << 20)
    first = decoded.parts[0].outputs
    assert first is not None and first["text_output"].tobytes() == b"ab" and first["text_output"].shape == (1, 2)
    assert first["logit"].dtype == np.float32 and float(first["logit"][0, 0]) == 0.5
    assert decoded.parts[1:] == message.parts[1:]


def test_a_step_whose_part_holds_objects_is_pickled_whole() -> None:
    message = StepDone(1, (SequencePart(1, {"text_output": np.array(["x"], dtype=object)}),), 0.001)
    frame = encode_message(message)
    assert frame[:1] == b"P"
    decoded = decode_message(frame)
    assert isinstance(decoded, StepDone) and decoded.parts[0].outputs is not None
    assert decoded.parts[0].outputs["text_output"].tolist() == ["x"]


@pytest.mark.parametrize("message", [Shutdown(), LoadProgress("warm-up", 1.5), BatchFailed(3, "boom", fatal=True)])
def test_other_messages_are_pickled_and_come_back_equal(message: object) -> None:
    frame = encode_message(message)  # type: ignore[arg-type]
    assert frame[:1] == b"P"
    assert decode_message(frame) == message


def test_numpy_numbers_arrive_as_numbers_not_as_their_bytes() -> None:
    refs = (TensorRef("x", "<f4", (np.int64(2), np.int64(3)), np.int64(0), np.int64(24)),)  # type: ignore[arg-type]
    message = BatchDone(np.int64(1), "seg", refs, np.float32(0.5), np.int64(7), np.int32(2),  # type: ignore[arg-type]
                        (("step", np.float32(0.25)),), np.int64(8), (np.int64(0),))  # type: ignore[arg-type]
    decoded = decode_message(encode_message(message))
    ref = TensorRef("x", "<f4", (2, 3), 0, 24)
    assert decoded == BatchDone(1, "seg", (ref,), 0.5, 7, 2, (("step", 0.25),), 8, (0,))
    assert isinstance(decoded, BatchDone)
    assert all(type(v) is int for v in (decoded.batch_id, decoded.rss_bytes, *decoded.outputs[0].shape))


class Name(str):
    """A str subclass: marshal refuses it."""


def test_a_batch_message_marshal_cannot_write_is_pickled_instead() -> None:
    message = RunBatch(1, Name("seg"), REFS)
    frame = encode_message(message)
    assert frame[:1] == b"P"
    assert decode_message(frame) == message


@pytest.mark.parametrize("frame", [b"", b"X123", b"\x80\x05junk"])
def test_a_frame_of_unknown_kind_is_refused(frame: bytes) -> None:
    with pytest.raises(ValueError, match="not a worker message frame"):
        decode_message(frame)


def test_messages_cross_a_real_pipe() -> None:
    left, right = multiprocessing.Pipe(duplex=True)
    try:
        sent = RunBatch(11, "seg", REFS, None, (2,), (99.0,))
        send_message(left, sent)
        send_message(left, Shutdown())
        assert receive_message(right) == sent
        assert isinstance(receive_message(right), Shutdown)
    finally:
        left.close()
        right.close()


def test_a_batch_reports_memory_read_at_most_every_interval() -> None:
    readings = iter([100, 200, 300])
    now = [1000.0]
    rss = process_main.RssReading(lambda: next(readings), lambda: now[0])
    assert rss.read() == 100  # the first batch reads
    now[0] += process_main.RSS_EVERY_S / 2
    assert rss.read() == 100  # within the interval: the last reading
    now[0] += process_main.RSS_EVERY_S
    assert rss.read() == 200
