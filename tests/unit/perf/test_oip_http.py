"""Request bodies match what tritonclient (the field's reference client) sends for the same tensors."""

from __future__ import annotations

import json

import numpy as np
import tritonclient.http as triton

from servewell.perf.inputs import Tensor
from servewell.perf.oip_http import error_code, infer_body


def _reference(arrays, binary):
    inputs = []
    for name, datatype, array in arrays:
        item = triton.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    outputs = [triton.InferRequestedOutput("y", binary_data=True)] if binary else None
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    return body, json_size


ARRAYS = [
    ("x", "FP32", np.arange(6, dtype=np.float32).reshape(2, 3)),
    ("ids", "INT64", np.array([[1, 2]], dtype=np.int64)),
    ("text", "BYTES", np.array([b"ab", b"cde"], dtype=object)),
]


def _tensors():
    return [Tensor(name, datatype, array.shape, array.reshape(-1) if datatype == "BYTES" else array)
            for name, datatype, array in ARRAYS]


def test_binary_bodies_match_tritonclient_byte_for_byte_after_the_json_header():
    body, headers, content_type = infer_body(_tensors(), "binary", outputs=["y"])
    reference, reference_json_size = _reference(ARRAYS, binary=True)
    size = int(headers["Inference-Header-Content-Length"])
    assert content_type == "application/octet-stream"
    assert body[size:] == reference[reference_json_size:]
    ours, theirs = json.loads(body[:size]), json.loads(reference[:reference_json_size])
    assert [(i["name"], i["shape"], i["datatype"], i["parameters"]["binary_data_size"]) for i in ours["inputs"]] == \
        [(i["name"], i["shape"], i["datatype"], i["parameters"]["binary_data_size"]) for i in theirs["inputs"]]
    assert ours["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]


def test_json_bodies_carry_the_same_data_as_tritonclient():
    body, headers, content_type = infer_body(_tensors(), "json")
    reference, json_size = _reference(ARRAYS, binary=False)
    assert content_type == "application/json" and headers == {}
    ours = json.loads(body)
    theirs = json.loads(reference if json_size is None else reference[:json_size])
    assert [(i["name"], i["shape"], i["datatype"], i["data"]) for i in ours["inputs"]] == \
        [(i["name"], i["shape"], i["datatype"], i["data"]) for i in theirs["inputs"]]


def test_encoded_images_are_base64_in_json_and_raw_in_binary():
    images = np.empty(1, dtype=object)
    images[:] = [b"\xff\xd8jpeg"]
    tensor = Tensor("input", "BYTES", (1,), images, images=True)
    body, _, _ = infer_body([tensor], "json")
    assert json.loads(body)["inputs"][0]["data"] == ["/9hqcGVn"]
    body, headers, _ = infer_body([tensor], "binary")
    assert body[int(headers["Inference-Header-Content-Length"]):] == b"\x06\x00\x00\x00\xff\xd8jpeg"


def test_error_codes_are_read_from_servewell_bodies_only():
    assert error_code(b'{"error": {"code": "overloaded", "message": "m", "request_id": "r"}}') == "overloaded"
    assert error_code(b'{"error": "overloaded; retry", "code": "overloaded", "request_id": "r"}') == "overloaded"
    assert error_code(b'{"error": "Triton says no"}') is None
    assert error_code(b'["error"]') is None
    assert error_code(b"<html>") is None
