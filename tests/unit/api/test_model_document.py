"""One OIP model document for both ports (api/model_document.py): the JSON HTTP answers is, field for
field, the protobuf gRPC answers, and `parameters.timeout` follows one rule whichever port carries it."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from google.protobuf import json_format  # type: ignore[import-untyped]  # no stubs installed
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from servewell.api.grpc.codec import config_message, decode_request, metadata_message
from servewell.api.model_document import (
    MAX_TIMEOUT_US,
    config_json,
    metadata_json,
    model_document,
    timeout_us_of,
)
from servewell.config.model import ModelConfig
from servewell.config.runtimes import runtimes
from servewell.engine.protocol import ModelView, SchedulingFacts
from servewell.errors import InvalidInput


def view(scheduled_max: int | None = None, **fields: Any) -> ModelView:
    config = ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "BYTES", "shape": [-1]}], **fields,
    })
    scheduling = None if scheduled_max is None else SchedulingFacts(0, {}, 0, scheduled_max, 0, 0, 0, 0, 0)
    return ModelView("m", config.version, "ready", None, config, 1.0, 0, 0, (), scheduling, "float16")


def test_every_runtime_has_a_triton_platform_and_backend():
    names = {runtime.name: (runtime.triton_platform, runtime.triton_backend) for runtime in runtimes()}
    assert {name: names[name] for name in ("onnx", "torchscript", "pytorch", "python", "pipeline")} == {
        "onnx": ("onnxruntime_onnx", "onnxruntime"), "torchscript": ("pytorch_libtorch", "pytorch"),
        "pytorch": ("pytorch", "pytorch"), "python": ("python", "python"), "pipeline": ("ensemble", "")}
    assert all(platform for platform, _ in names.values())  # a pipeline alone has no backend


def test_the_document_carries_triton_names_and_the_live_batch_size():
    doc = model_document(view(scheduled_max=4, device="cuda:0", metadata={"team": "a"},
                              batching={"policy": "window", "max_wait_ms": 2.5}))
    assert (doc.platform, doc.backend, doc.max_batch_size, doc.instance_kind) == (
        "onnxruntime_onnx", "onnxruntime", 4, "KIND_GPU")
    assert [(t.data_type, t.dims, t.shape) for t in doc.outputs] == [("TYPE_STRING", [-1], [-1, -1])]
    assert (doc.max_queue_delay_us, doc.priority_levels) == (2500, 2)
    assert doc.parameters == {"team": "a", "batching_policy": "window", "serving_dtype": "float16"}


@pytest.mark.parametrize("fields", [{}, {"max_batch_size": 0, "device": "cuda", "metadata": {"k": "v"}}])
def test_http_json_and_grpc_protobuf_are_the_same_message(fields):
    doc = model_document(view(scheduled_max=4, **fields))
    # Parsing fails on any field Triton's messages do not have: HTTP may not say more than gRPC.
    http_config = json_format.ParseDict(orjson.loads(orjson.dumps(config_json(doc))), mc.ModelConfig())
    assert http_config == config_message(doc)
    http_meta = json_format.ParseDict(orjson.loads(orjson.dumps(metadata_json(doc))), pb.ModelMetadataResponse())
    assert http_meta == metadata_message(doc)


def test_a_model_whose_config_is_invalid_has_no_document():
    broken = ModelView("m", "1", "invalid", "max_batch_size: not an integer", None, None, 0, 0, (), None)
    with pytest.raises(InvalidInput, match="not an integer"):
        model_document(broken)


def grpc_timeout(**choice: Any) -> int | None:
    """`parameters.timeout` as a gRPC ModelInferRequest carries it (int64, uint64, double, string or bool)."""
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1])
    request.raw_input_contents.append(np.zeros(1, np.float32).tobytes())
    for kind, value in choice.items():
        setattr(request.parameters["timeout"], kind, value)
    return decode_request(request).timeout_us


def http_timeout(raw: str) -> int | None:
    return timeout_us_of(orjson.loads(f'{{"timeout": {raw}}}')["timeout"])


@pytest.mark.parametrize(("raw", "grpc_kind", "value", "expected"), [
    ("30000", "int64_param", 30000, 30000),
    ("30000.0", "double_param", 30000.0, 30000),  # a whole float: JSON clients write numbers as they like
    ("0", "int64_param", 0, None),  # Triton: 0 is no timeout of its own, the model's default applies
    (str(MAX_TIMEOUT_US), "uint64_param", MAX_TIMEOUT_US, MAX_TIMEOUT_US),
])
def test_both_ports_accept_the_same_timeouts(raw, grpc_kind, value, expected):
    assert http_timeout(raw) == expected
    assert grpc_timeout(**{grpc_kind: value}) == expected


@pytest.mark.parametrize(("raw", "grpc_kind", "value"), [
    ("1500.5", "double_param", 1500.5),  # a fraction of a microsecond
    ("-1", "int64_param", -1),
    (str(MAX_TIMEOUT_US + 1), "uint64_param", MAX_TIMEOUT_US + 1),  # past a day
    ("1e300", "double_param", 1e300),
    ("true", "bool_param", True),
    ('"30000"', "string_param", "30000"),
])
def test_both_ports_refuse_the_same_timeouts_naming_the_parameter(raw, grpc_kind, value):
    with pytest.raises(InvalidInput, match="parameters.timeout"):
        http_timeout(raw)
    with pytest.raises(InvalidInput, match="parameters.timeout"):
        grpc_timeout(**{grpc_kind: value})


def test_no_timeout_given_is_none_on_both_ports():
    assert timeout_us_of(None) is None
    assert grpc_timeout() is None
