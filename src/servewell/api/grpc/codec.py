"""OIP v2 gRPC messages (Triton's `inference.GRPCInferenceService`, a superset of KServe's) to and
from numpy: raw contents or typed contents in, raw contents out (as Triton answers)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from servewell.api.codecs.tensors import DecodedTensor, run_steps, tensor_from_raw, tensor_from_values, tensor_to_raw
from servewell.api.model_document import ModelDocument, timeout_us_of
from servewell.errors import InvalidInput, quote

#: Which typed-contents field carries each datatype (FP16 and BF16 travel only as raw contents).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


@dataclass(slots=True, frozen=True)
class GrpcInferRequest:
    """A decoded `ModelInferRequest`."""

    inputs: list[DecodedTensor]
    requested_outputs: list[str] | None
    priority: object
    timeout_us: int | None


def parameter_value(parameter: pb.InferParameter) -> object:
    """The value of an `InferParameter` whichever of its fields is set."""
    kind = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, kind) if kind else None


def decode_request(request: pb.ModelInferRequest) -> GrpcInferRequest:
    """Tensors and scheduling parameters of a request; `InvalidInput` for anything malformed."""
    if not request.inputs:
        raise InvalidInput("the request has no inputs")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: send raw contents "
                           "for every input or for none")
    if raw:  # Triton refuses both: which one holds the data would be a guess
        both = [tensor.name for tensor in request.inputs if tensor.HasField("contents")]
        if both:
            raise InvalidInput(f"input {quote(both[0])} has contents although the request carries "
                               "raw_input_contents: send raw contents or typed contents, not both")
    tensors = []
    for index, tensor in enumerate(request.inputs):
        shape = list(tensor.shape)
        if raw:
            array = tensor_from_raw(tensor.name, tensor.datatype, shape, raw[index])
        else:
            field = CONTENTS_FIELD.get(tensor.datatype)
            if field is None:
                raise InvalidInput(f"input {quote(tensor.name)}: datatype {quote(tensor.datatype)} travels only "
                                   "as raw_input_contents")
            array = tensor_from_values(tensor.name, tensor.datatype, shape, getattr(tensor.contents, field))
        tensors.append(DecodedTensor(tensor.name, tensor.datatype, array, from_binary=True))
    parameters = {key: parameter_value(value) for key, value in request.parameters.items()}
    timeout_us = timeout_us_of(parameters.get("timeout"))  # int64, uint64 or a whole double: the HTTP rule
    requested = [output.name for output in request.outputs] or None
    return GrpcInferRequest(tensors, requested, parameters.get("priority"), timeout_us)


def encode_response(model: str, version: str, request_id: str, outputs: dict[str, np.ndarray]) -> pb.ModelInferResponse:
    """A `ModelInferResponse` with every output as raw contents."""
    return run_steps(response_steps(model, version, request_id, outputs))


def response_steps(model: str, version: str, request_id: str,
                   outputs: dict[str, np.ndarray]) -> Generator[None, None, pb.ModelInferResponse]:
    """`encode_response` as steps, one output each (the generator yields between them and returns the
    message), so the event loop takes a turn between the copies of a large answer's outputs."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for index, (name, array) in enumerate(outputs.items()):
        if index:
            yield
        datatype, blob = tensor_to_raw(name, array)
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(blob)
    return response


def metadata_message(doc: ModelDocument) -> pb.ModelMetadataResponse:
    """`ModelMetadataResponse` of a model: the fields of `model_document.metadata_json`."""
    response = pb.ModelMetadataResponse(name=doc.name, versions=doc.versions, platform=doc.platform)
    for t in doc.inputs:
        response.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
    for t in doc.outputs:
        response.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
    return response


def config_message(doc: ModelDocument) -> mc.ModelConfig:
    """Triton's `ModelConfig` message of a model: the fields of `model_document.config_json`."""
    return mc.ModelConfig(
        name=doc.name, platform=doc.platform, backend=doc.backend, max_batch_size=doc.max_batch_size,
        input=[mc.ModelInput(name=t.name, data_type=mc.DataType.Value(t.data_type), dims=t.dims) for t in doc.inputs],
        output=[mc.ModelOutput(name=t.name, data_type=mc.DataType.Value(t.data_type), dims=t.dims)
                for t in doc.outputs],
        instance_group=[mc.ModelInstanceGroup(count=doc.instance_count,
                                              kind=mc.ModelInstanceGroup.Kind.Value(doc.instance_kind))],
        dynamic_batching=mc.ModelDynamicBatching(max_queue_delay_microseconds=doc.max_queue_delay_us,
                                                 priority_levels=doc.priority_levels),
        parameters={key: mc.ModelParameter(string_value=value) for key, value in doc.parameters.items()},
    )


def metadata_value(metadata: Any, key: str) -> str | None:
    """A single metadata value (gRPC keys are lower case); None when absent or binary."""
    for item_key, value in metadata or ():
        if item_key == key and isinstance(value, str):
            return value
    return None
