"""One definition of the OIP facts that HTTP and gRPC both tell: a model's metadata and Triton-style
config (`ModelDocument`), with the Triton platform and backend names of each model's runtime (its
descriptor's: config/runtimes.py), Triton's repository states, and the request parameters both
ports parse (`timeout_us_of`).

`routes_v2.py` renders a document as JSON and `grpc/codec.py` as protobuf; neither adds a field of
its own, so `GET /v2/models/{name}/config` parsed into Triton's `ModelConfig` message equals what
`ModelConfig` answers over gRPC (tests/e2e/test_grpc.py checks it for every runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servewell.config.model import TensorSpec
from servewell.engine.protocol import ModelView, client_shape
from servewell.errors import InvalidInput, quote

#: Our model states -> the states of Triton's repository index (anything else: UNAVAILABLE).
TRITON_STATES: dict[str, str] = {"ready": "READY", "loading": "LOADING", "restarting": "LOADING"}

#: `parameters.timeout` above this is refused: a day is longer than any client waits for an answer,
#: and a larger deadline only keeps a forgotten request queued (Triton's int64 would allow 292,000 years).
MAX_TIMEOUT_US = 86_400 * 1_000_000


@dataclass(slots=True, frozen=True)
class TensorDocument:
    """One input or output: OIP metadata names it with `datatype` and the client's `shape` (batch
    dimension -1 first when the model batches); Triton's config with `data_type` and `dims` (no batch)."""

    name: str
    datatype: str
    shape: list[int]
    data_type: str
    dims: list[int]


@dataclass(slots=True, frozen=True)
class ModelDocument:
    """What a model's metadata and config say, in OIP/Triton terms, the same on every port."""

    name: str
    versions: list[str]
    platform: str
    backend: str
    max_batch_size: int  #: the live value (a live-config change or the memory budget may lower it)
    inputs: list[TensorDocument]
    outputs: list[TensorDocument]
    instance_count: int
    instance_kind: str  #: Triton's KIND_CPU or KIND_GPU
    max_queue_delay_us: int
    priority_levels: int
    parameters: dict[str, str]  #: config `parameters` (Triton's string_value map)


def triton_data_type(datatype: str) -> str:
    """Triton's config `DataType` name of an OIP datatype (BYTES is TYPE_STRING there)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_document(view: ModelView) -> ModelDocument:
    """The document of a model whose model.yaml is valid; `InvalidInput` (with the reason) otherwise."""
    config = view.config
    if config is None:
        raise InvalidInput(f"model '{view.name}' is invalid: {view.reason}")
    live_max = view.scheduling.max_batch_size if view.scheduling and config.max_batch_size else config.max_batch_size

    def tensor(spec: TensorSpec) -> TensorDocument:
        return TensorDocument(spec.name, spec.datatype, client_shape(config, spec), triton_data_type(spec.datatype),
                              list(spec.shape))

    parameters = dict(config.metadata)  # the model's free-form facts first: our own names win a clash
    parameters["batching_policy"] = config.batching.policy
    if view.serving_dtype:
        parameters["serving_dtype"] = view.serving_dtype  # what dtype auto chose, after warm-up
    if config.image_input:
        parameters["image_input"] = config.image_input
    runtime = config.runtime_descriptor  # Triton's names for the same kind of model (tritonclient branches on them)
    return ModelDocument(
        name=config.name, versions=list(view.versions) or [view.version], platform=runtime.triton_platform,
        backend=runtime.triton_backend, max_batch_size=live_max,
        inputs=[tensor(t) for t in config.inputs], outputs=[tensor(t) for t in config.outputs],
        instance_count=config.instances, instance_kind="KIND_GPU" if config.device.startswith("cuda") else "KIND_CPU",
        max_queue_delay_us=int(config.batching.max_wait_ms * 1000), priority_levels=len(config.batching.lanes),
        parameters=parameters,
    )


def metadata_json(doc: ModelDocument) -> dict[str, Any]:
    """OIP model metadata as JSON: the fields gRPC's `ModelMetadataResponse` has (HTTP adds state and
    parameters beside them, routes_v2.py)."""
    return {
        "name": doc.name, "versions": doc.versions, "platform": doc.platform,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape} for t in doc.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape} for t in doc.outputs],
    }


def config_json(doc: ModelDocument) -> dict[str, Any]:
    """Triton's `ModelConfig` as JSON, field for field what gRPC's `ModelConfig` answers."""

    def tensor(t: TensorDocument) -> dict[str, Any]:
        return {"name": t.name, "data_type": t.data_type, "dims": t.dims}

    return {
        "name": doc.name, "platform": doc.platform, "backend": doc.backend, "max_batch_size": doc.max_batch_size,
        "input": [tensor(t) for t in doc.inputs], "output": [tensor(t) for t in doc.outputs],
        "instance_group": [{"count": doc.instance_count, "kind": doc.instance_kind}],
        "dynamic_batching": {"max_queue_delay_microseconds": doc.max_queue_delay_us,
                             "priority_levels": doc.priority_levels},
        "parameters": {key: {"string_value": value} for key, value in doc.parameters.items()},
    }


def timeout_us_of(value: object) -> int | None:
    """The OIP `parameters.timeout` of a request, from JSON (HTTP) or an `InferParameter` (gRPC): a
    whole number of microseconds as Triton defines it, 0 meaning none (the model's default_timeout_ms
    applies, as in Triton). A float that is whole (`5000.0`) counts; a fraction, a negative, a bool,
    text or more than a day is `InvalidInput` naming the parameter. None when absent or 0."""
    if value is None:
        return None
    whole = int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(whole, bool) or not isinstance(whole, int) or not 0 <= whole <= MAX_TIMEOUT_US:
        raise InvalidInput(f"parameters.timeout must be a whole number of microseconds from 0 (none) to "
                           f"{MAX_TIMEOUT_US} (a day), got {quote(value)}")
    return whole or None
