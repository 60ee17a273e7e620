"""Request inputs from OIP metadata (HTTP and gRPC forms), .npy files and images."""

from __future__ import annotations

import numpy as np
import pytest

from servewell.perf.inputs import (
    MAX_TENSOR_ELEMENTS,
    InputError,
    ModelMeta,
    generate_inputs,
    image_inputs,
    npy_inputs,
    parse_input_files,
    parse_shape_overrides,
)

SERVEWELL_METADATA = {
    "name": "digits", "versions": ["1"], "platform": "onnxruntime_onnx",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}],
    "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
    "parameters": {"max_batch_size": 64, "image_input": "input (also accepts BYTES: encoded images)"},
}


def _meta(inputs, max_batch_size=None):
    doc = {"name": "m", "inputs": inputs, "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}
    if max_batch_size is not None:
        doc["parameters"] = {"max_batch_size": max_batch_size}
    return ModelMeta.from_metadata(doc)


def test_servewell_metadata_names_its_batch_size_and_image_input():
    meta = ModelMeta.from_metadata(SERVEWELL_METADATA)
    assert meta.inputs[0].shape == (-1, 1, 8, 8)
    assert meta.max_batch_size == 64 and meta.batches
    assert meta.image_input == "input"


def test_grpc_json_metadata_has_int64_dims_as_strings():
    meta = ModelMeta.from_metadata({"name": "m", "versions": ["1"], "platform": "x",
                                    "inputs": [{"name": "x", "datatype": "INT64", "shape": ["-1", "16"]}],
                                    "outputs": [{"name": "y", "datatype": "FP32", "shape": ["-1", "2"]}]})
    assert meta.inputs[0].shape == (-1, 16)
    assert meta.max_batch_size is None and meta.batches  # every input leads with -1


def test_metadata_that_is_not_oip_is_an_input_error():
    with pytest.raises(InputError):
        ModelMeta.from_metadata({"inputs": []})
    with pytest.raises(InputError):
        ModelMeta.from_metadata({"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": ["a"]}]})


def test_generated_inputs_fill_the_batch_dimension_and_the_variable_ones():
    meta = _meta([{"name": "tokens", "datatype": "INT64", "shape": [-1, -1]},
                  {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]},
                  {"name": "scale", "datatype": "FP16", "shape": [-1, 3]}], max_batch_size=8)
    requests = generate_inputs(meta, variants=3, batch_size=4, dynamic_size=5)
    assert len(requests) == 3
    tokens, mask, scale = requests[0]
    assert tokens.shape == tokens.array.shape == (4, 5) and tokens.array.dtype == np.int64
    assert tokens.array.min() >= 0 and tokens.array.max() < 100
    assert mask.array.dtype == np.bool_ and mask.shape == (4, 5)
    assert scale.array.dtype == np.float16 and scale.shape == (4, 3)
    assert not np.array_equal(requests[0][0].array, requests[1][0].array)  # variants differ


def test_generated_inputs_are_the_same_for_the_same_seed():
    meta = ModelMeta.from_metadata(SERVEWELL_METADATA)
    first = generate_inputs(meta, seed=7)[0][0].array
    again = generate_inputs(meta, seed=7)[0][0].array
    other = generate_inputs(meta, seed=8)[0][0].array
    assert np.array_equal(first, again) and not np.array_equal(first, other)


def test_a_model_without_a_batch_dimension_keeps_its_shape_and_refuses_batches():
    meta = _meta([{"name": "x", "datatype": "UINT8", "shape": [3, -1]}], max_batch_size=0)
    (tensor,) = generate_inputs(meta, dynamic_size=6)[0]
    assert tensor.shape == (3, 6) and tensor.array.dtype == np.uint8
    with pytest.raises(InputError, match="no batch dimension"):
        generate_inputs(meta, batch_size=2)


def test_bytes_inputs_get_short_strings():
    meta = _meta([{"name": "text", "datatype": "BYTES", "shape": [-1, 2]}], max_batch_size=4)
    (tensor,) = generate_inputs(meta)[0]
    assert tensor.shape == (1, 2) and len(tensor.array) == 2
    assert all(isinstance(b, bytes) and len(b) == 8 for b in tensor.array)


def test_shape_overrides_must_fit_the_declared_shape():
    meta = _meta([{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1]}], max_batch_size=8)
    (tensor,) = generate_inputs(meta, shapes={"x": [2, 3, 7]})[0]
    assert tensor.shape == (2, 3, 7)
    with pytest.raises(InputError, match="declares"):
        generate_inputs(meta, shapes={"x": [2, 4, 7]})
    with pytest.raises(InputError, match="does not take"):
        generate_inputs(meta, shapes={"y": [1]})
    assert parse_shape_overrides(["x:2,3,7"]) == {"x": [2, 3, 7]}
    with pytest.raises(InputError):
        parse_shape_overrides(["x=2,3"])


def test_a_huge_generated_tensor_is_refused_before_it_is_allocated():
    meta = _meta([{"name": "x", "datatype": "FP32", "shape": [-1, -1, -1]}], max_batch_size=8)
    with pytest.raises(InputError, match="elements"):
        generate_inputs(meta, dynamic_size=int(MAX_TENSOR_ELEMENTS ** 0.5) + 1)


def test_npy_files_get_a_batch_dimension_and_a_compatible_dtype(tmp_path):
    meta = ModelMeta.from_metadata(SERVEWELL_METADATA)
    path = tmp_path / "x.npy"
    np.save(path, np.ones((1, 8, 8), dtype=np.float64))
    (tensor,) = npy_inputs(meta, parse_input_files([str(path)], meta))[0]
    assert tensor.shape == (1, 1, 8, 8) and tensor.array.dtype == np.float32
    np.save(path, np.full((1, 8, 8), "a"))
    with pytest.raises(InputError, match="FP32"):
        npy_inputs(meta, {"input": path})
    ints = _meta([{"name": "ids", "datatype": "INT64", "shape": [-1, 4]}], max_batch_size=8)
    np.save(path, np.ones((4,), dtype=np.float32))
    with pytest.raises(InputError, match="INT64"):
        npy_inputs(ints, {"ids": path})
    np.save(path, np.ones((2, 8), dtype=np.float32))
    with pytest.raises(InputError, match="shape"):
        npy_inputs(meta, {"input": path})
    with pytest.raises(InputError, match="one .npy file per input"):
        npy_inputs(meta, {"other": path})


def test_images_go_as_bytes_to_the_image_input(tmp_path):
    meta = ModelMeta.from_metadata(SERVEWELL_METADATA)
    image = tmp_path / "digit.png"
    image.write_bytes(b"\x89PNG fake")
    (tensor,) = image_inputs(meta, [image], batch_size=2)[0]
    assert tensor.name == "input" and tensor.datatype == "BYTES" and tensor.images
    assert tensor.shape == (2,) and list(tensor.array) == [b"\x89PNG fake"] * 2
    with pytest.raises(InputError, match="cannot read"):
        image_inputs(meta, [tmp_path / "missing.png"])
