"""Malformed OIP v2 requests (issue 11, class 4): each is a ServeError (4xx), never another exception,
and none allocates more than its body could hold."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from servewell.api.codecs.tensors import MAX_DIMS, MAX_NESTING, encode_infer_response, parse_infer_request
from servewell.errors import ECHO_LIMIT, BadRequest, InvalidInput, ServeError


def body(doc) -> bytes:
    """The JSON of `doc`, where a `Deep` value is written as lists nested `depth` deep (orjson
    would refuse to write them, but a client can send them)."""
    raw = orjson.dumps(doc, default=lambda d: f"@DEEP{d.depth}:{d.leaf}@")
    for deep in Deep.made:
        raw = raw.replace(
            orjson.dumps(f"@DEEP{deep.depth}:{deep.leaf}@"),
            b"[" * deep.depth + orjson.dumps(deep.leaf) + b"]" * deep.depth,
        )
    return raw


def tensor(**fields):
    return {"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0], **fields}


class Deep:
    """Lists nested `depth` deep around `leaf`."""

    made: list[Deep] = []

    def __init__(self, depth: int, leaf) -> None:
        self.depth, self.leaf = depth, leaf
        Deep.made.append(self)


def nested(depth: int, leaf):
    return Deep(depth, leaf)


JSON_CASES = [
    ("datatype-object", {"inputs": [tensor(datatype={"a": 1})]}),
    ("datatype-list", {"inputs": [tensor(datatype=["FP32"])]}),
    ("datatype-number", {"inputs": [tensor(datatype=32)]}),
    ("shape-product-overflows", {"inputs": [tensor(shape=[4294967296, 4294967296], data=[])]}),
    ("shape-product-overflows-to-zero", {"inputs": [tensor(shape=[2**32, 2**32, 0], data=[])]}),
    ("shape-too-many-dims", {"inputs": [tensor(shape=[1] * (MAX_DIMS + 1), data=[1.0])]}),
    ("shape-huge-dim", {"inputs": [tensor(shape=[2**62], data=[1.0])]}),
    ("shape-bool-dim", {"inputs": [tensor(shape=[True], data=[1.0])]}),
    ("shape-not-a-list", {"inputs": [tensor(shape="1")]}),
    ("outputs-parameters-not-object", {"inputs": [tensor()], "outputs": [{"name": "y", "parameters": [1]}]}),
    ("outputs-parameters-string", {"inputs": [tensor()], "outputs": [{"name": "y", "parameters": "binary"}]}),
    ("inputs-parameters-not-object", {"inputs": [tensor(parameters=[1])]}),
    ("bytes-nested-deeply", {"inputs": [tensor(datatype="BYTES", data=nested(1000, "a"))]}),
    ("bytes-nested-past-cap", {"inputs": [tensor(datatype="BYTES", data=nested(MAX_NESTING + 1, "a"))]}),
    ("numbers-nested-deeply", {"inputs": [tensor(data=nested(1000, 1.0))]}),
    ("null-in-fp32", {"inputs": [tensor(shape=[2], data=[1.0, None])]}),
    ("string-in-fp32", {"inputs": [tensor(shape=[2], data=[1.0, "2"])]}),
    ("object-in-fp32", {"inputs": [tensor(shape=[2], data=[1.0, {"v": 2}])]}),
    ("bools-in-fp32", {"inputs": [tensor(shape=[2], data=[True, False])]}),
    ("float-in-int32", {"inputs": [tensor(shape=[2], datatype="INT32", data=[1, 2.5])]}),
    ("int8-out-of-range", {"inputs": [tensor(shape=[1], datatype="INT8", data=[300])]}),
    ("uint8-negative", {"inputs": [tensor(shape=[1], datatype="UINT8", data=[-1])]}),
    ("int64-beyond-64-bits", {"inputs": [tensor(shape=[1], datatype="INT64", data=[2**63])]}),
    ("fp16-overflows-to-inf", {"inputs": [tensor(shape=[1], datatype="FP16", data=[1e6])]}),
    ("fp32-overflows-to-inf", {"inputs": [tensor(shape=[1], datatype="FP32", data=[1e300])]}),
    ("ragged-data", {"inputs": [tensor(shape=[2, 2], data=[[1.0, 2.0], [3.0]])]}),
    ("data-scalar", {"inputs": [tensor(data=1.0)]}),
    ("id-not-a-string", {"id": nested(900, 1), "inputs": [tensor()]}),
    (
        "binary-size-bool",
        {"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "parameters": {"binary_data_size": True}}]},
    ),
    ("name-not-a-string", {"inputs": [tensor(name=["x"])]}),
    ("name-empty", {"inputs": [tensor(name="")]}),
]


@pytest.mark.parametrize("doc", [c[1] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_malformed_json_requests_are_client_errors(doc):
    with pytest.raises(ServeError) as caught:
        parse_infer_request(body(doc), None)
    assert 400 <= caught.value.status < 500
    assert len(caught.value.message) < 400


def test_binary_shape_overflow_is_a_client_error_before_any_allocation():
    header = body(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [4294967296, 4294967296],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 0},
                }
            ]
        }
    )
    with pytest.raises(InvalidInput):
        parse_infer_request(header, len(header))


def test_binary_bytes_with_more_elements_than_the_shape_is_refused():
    blob = b"".join(struct.pack("<I", 1) + b"a" for _ in range(10))
    header = body(
        {"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(blob)}}]}
    )
    with pytest.raises(InvalidInput):
        parse_infer_request(header + blob, len(header))


def test_element_count_cannot_exceed_what_the_body_carries():
    # 10**6 zero-size rows claim nothing, but a shape of 10**6 elements with no data is impossible.
    with pytest.raises(InvalidInput, match="more elements"):
        parse_infer_request(body({"inputs": [tensor(shape=[10**6], data=[])]}), None)


def test_an_empty_tensor_is_still_accepted():
    parsed = parse_infer_request(body({"inputs": [tensor(shape=[0, 3], data=[])]}), None)
    assert parsed.inputs[0].array.shape == (0, 3)


def test_bytes_nested_to_the_shape_are_accepted():
    parsed = parse_infer_request(body({"inputs": [tensor(shape=[2, 1], datatype="BYTES", data=[["a"], ["b"]])]}), None)
    assert parsed.inputs[0].array.reshape(-1).tolist() == [b"a", b"b"]


def test_integers_are_accepted_in_float_tensors():
    parsed = parse_infer_request(body({"inputs": [tensor(shape=[2], data=[1, 2.5])]}), None)
    assert parsed.inputs[0].array.tolist() == [1.0, 2.5]


def test_echoed_client_strings_are_bounded():
    long = "n" * 100_000
    for doc in (
        {"inputs": [tensor(name=long, datatype="FP99")]},
        {"inputs": [tensor(datatype=long)]},
        {"inputs": [tensor(name=long, shape=[3])]},
        {"inputs": [tensor(name=long, data=[None])]},
    ):
        with pytest.raises(ServeError) as caught:
            parse_infer_request(body(doc), None)
        assert len(caught.value.message) < 4 * ECHO_LIMIT + 200


def test_non_finite_outputs_are_null_in_json_and_exact_in_binary():
    outputs = {"y": np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)}
    raw, length = encode_infer_response("m", "1", None, outputs, set())
    assert length is None and orjson.loads(raw)["outputs"][0]["data"] == [None, None, None, 1.0]
    raw, length = encode_infer_response("m", "1", None, outputs, {"y"})
    assert length is not None
    values = np.frombuffer(raw[length:], dtype="<f4")
    assert np.isnan(values[0]) and values[1] == np.inf and values[2] == -np.inf and values[3] == 1.0


def test_bad_header_length_is_a_bad_request():
    with pytest.raises(BadRequest):
        parse_infer_request(b"{}", 10)
