import struct

import numpy as np
import orjson
import pytest

from servewell.api.codecs.tensors import encode_infer_response, parse_infer_request
from servewell.errors import BadRequest, InvalidInput


def body(doc) -> bytes:
    return orjson.dumps(doc)


@pytest.mark.parametrize("datatype,values,dtype", [
    ("FP32", [1.5, -2.0], np.float32), ("FP64", [1.5, 2.5], np.float64), ("FP16", [0.5, 1.0], np.float16),
    ("INT8", [-3, 4], np.int8), ("INT16", [-3, 4], np.int16), ("INT32", [7, 8], np.int32),
    ("INT64", [2**40, 1], np.int64), ("UINT8", [0, 255], np.uint8), ("UINT16", [1, 2], np.uint16),
    ("UINT32", [1, 2], np.uint32), ("UINT64", [1, 2], np.uint64), ("BOOL", [True, False], np.bool_),
])
def test_json_tensors_of_every_numeric_datatype(datatype, values, dtype):
    parsed = parse_infer_request(
        body({"inputs": [{"name": "x", "shape": [1, 2], "datatype": datatype, "data": values}]}), None)
    array = parsed.inputs[0].array
    assert array.dtype == dtype and array.shape == (1, 2)
    np.testing.assert_array_equal(array, np.array(values, dtype=dtype).reshape(1, 2))


def test_nested_json_data_is_accepted():
    parsed = parse_infer_request(
        body({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}]}), None)
    assert parsed.inputs[0].array.tolist() == [[1, 2], [3, 4]]


def test_binary_extension_inputs_and_bytes():
    floats = np.arange(6, dtype=np.float32)
    strings = b"".join(struct.pack("<I", len(s)) + s for s in (b"ab", b"xyz"))
    header = body({
        "inputs": [
            {"name": "f", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": floats.nbytes}},
            {"name": "s", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(strings)}},
        ],
        "parameters": {"binary_data_output": True},
    })
    parsed = parse_infer_request(header + floats.tobytes() + strings, len(header))
    np.testing.assert_array_equal(parsed.inputs[0].array, floats.reshape(2, 3))
    assert list(parsed.inputs[1].array) == [b"ab", b"xyz"]
    assert parsed.inputs[0].from_binary and parsed.all_binary


@pytest.mark.parametrize("doc,error", [
    ({"inputs": []}, InvalidInput),
    ({"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2]}]}, InvalidInput),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}]}, InvalidInput),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}]}, InvalidInput),
    ({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]}, InvalidInput),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [3]}]}, InvalidInput),
])
def test_malformed_tensors_are_invalid_input(doc, error):
    with pytest.raises(error):
        parse_infer_request(body(doc), None)


def test_bad_json_and_bad_binary_framing_are_bad_requests():
    with pytest.raises(BadRequest):
        parse_infer_request(b"{nope", None)
    header = body({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]})
    with pytest.raises(BadRequest):
        parse_infer_request(header + b"\0" * 4, len(header))  # fewer bytes than declared
    with pytest.raises(BadRequest):
        parse_infer_request(header, len(header) + 10)


def test_response_json_and_binary():
    outputs = {"y": np.array([[1.0, 2.0]], dtype=np.float32), "n": np.array([3], dtype=np.int64)}
    raw, length = encode_infer_response("m", "1", "abc", outputs, set())
    doc = orjson.loads(raw)
    assert length is None and doc["id"] == "abc"
    assert doc["outputs"][0] == {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
    raw, length = encode_infer_response("m", "1", None, outputs, {"y"})
    doc = orjson.loads(raw[:length])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    np.testing.assert_array_equal(np.frombuffer(raw[length:], dtype=np.float32), [1.0, 2.0])
