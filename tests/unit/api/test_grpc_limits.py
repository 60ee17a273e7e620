"""The pure parts of the gRPC bounds: the connection cap under the open-files limit, call slots,
and the retry-after trailer."""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2 as pb

from servewell.api.grpc.codec import decode_request
from servewell.api.grpc.limits import MIN_GRPC_CONNECTIONS, CallSlots, backstop_rpcs, grpc_connection_cap
from servewell.api.grpc.scope import retry_after_value
from servewell.errors import InvalidInput


def test_the_connection_cap_leaves_http_and_the_reserve_their_descriptors():
    assert grpc_connection_cap(1000, 20_000, 1040, 256) == 1000
    assert grpc_connection_cap(1000, 1024, 1040 - 512, 256) == 1024 - 528 - 256
    assert grpc_connection_cap(1000, 1024, 1040, 256) == MIN_GRPC_CONNECTIONS  # never none at all
    assert grpc_connection_cap(4, 1024, 1040, 256) == 4  # a smaller wish is kept


def test_grpcios_own_limit_is_only_a_backstop():
    assert backstop_rpcs(1000, 100, 1024) == 100_000
    assert backstop_rpcs(2, 1, 64) == 64


def test_call_slots_refuse_when_all_are_held_and_come_back():
    slots = CallSlots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take() and slots.taken == 2
    slots.give_back()
    assert slots.try_take()
    with pytest.raises(ValueError):
        CallSlots(0)


def test_a_slot_never_taken_cannot_be_given_back():
    with pytest.raises(RuntimeError):
        CallSlots(1).give_back()


def test_retry_after_is_whole_seconds_at_least_one():
    assert retry_after_value(0.2) == "1"
    assert retry_after_value(1.0) == "1"
    assert retry_after_value(2.1) == "3"


def test_raw_and_typed_contents_in_one_request_are_refused():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="a", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    request.raw_input_contents.append(b"\x00\x00\x80\x3f")
    with pytest.raises(InvalidInput, match="raw_input_contents"):
        decode_request(request)
