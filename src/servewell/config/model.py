"""Typed configuration of one model in a model repository (`<repo>/<name>/model.yaml`).

Every field carries a one-line description; `servewell models` and the README reuse it.
Unknown keys are rejected so that a typo is reported instead of silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Open Inference Protocol datatypes that numpy can hold, mapped to numpy dtype names.
#: BF16 is part of the protocol but numpy has no native bfloat16, so it is not offered.
OIP_TO_NUMPY: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "object",
}
NUMPY_TO_OIP: dict[str, str] = {v: k for k, v in OIP_TO_NUMPY.items()}

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]
RuntimeName = Literal["onnx", "torchscript", "pytorch"]
ServingDtype = Literal["fp32", "fp16", "bf16", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    """One named input or output tensor of a model."""

    name: str = Field(description="Tensor name as the model and the API know it.")
    datatype: Datatype = Field(description="Open Inference Protocol datatype, e.g. FP32.")
    shape: list[int] = Field(
        description="Shape of one item, without the batch dimension; -1 marks a variable size."
    )

    @field_validator("shape")
    @classmethod
    def _dims_valid(cls, shape: list[int]) -> list[int]:
        for dim in shape:
            if dim == 0 or dim < -1:
                raise ValueError(f"dimension {dim} is invalid; use a positive size or -1")
        return shape

    @property
    def numpy_dtype(self) -> str:
        """The numpy dtype name that holds this tensor."""
        return OIP_TO_NUMPY[self.datatype]


class ImagePreprocess(_Strict):
    """How `/predict` (and BYTES inputs of the OIP API) turn an encoded image into the input tensor."""

    input: str | None = Field(None, description="Input tensor fed by the image; default: the model's only input.")
    size: tuple[int, int] = Field(description="Target height and width in pixels.")
    channels: Literal[1, 3] = Field(3, description="1 for grayscale, 3 for RGB.")
    invert: bool = Field(False, description="Invert intensities (dark ink on paper becomes bright strokes).")
    fit: Literal["stretch", "ink_bbox", "center_crop"] = Field(
        "stretch",
        description="stretch: resize the whole image; ink_bbox: crop to the ink and centre it; "
        "center_crop: resize the short side then crop the centre.",
    )
    scale: float = Field(1.0 / 255.0, description="Multiplier applied to 0..255 pixel values.")
    mean: list[float] | None = Field(None, description="Per-channel mean subtracted after scaling.")
    std: list[float] | None = Field(None, description="Per-channel standard deviation divided after the mean.")
    layout: Literal["CHW", "HWC"] = Field("CHW", description="Memory layout of one image in the input tensor.")


class ClassifyPostprocess(_Strict):
    """How `/predict` turns an output tensor into a label."""

    output: str | None = Field(None, description="Output tensor holding scores; default: the model's first output.")
    labels: list[str] | None = Field(None, description="Class names by index; default: the index as a string.")
    top_k: int = Field(3, ge=1, description="How many of the best classes to return.")
    apply_softmax: bool = Field(True, description="Turn logits into probabilities before ranking.")


class BatchingConfig(_Strict):
    """How the model's scheduler groups requests into batches (all changeable while serving)."""

    policy: Literal["idle", "window", "adaptive"] = Field(
        "idle",
        description="idle: start a batch as soon as an instance is free; window: wait up to max_wait_ms for a "
        "fuller batch; adaptive: wait only as long as the learned batch-latency curve and latency_slo_ms allow.",
    )
    max_wait_ms: float = Field(25.0, ge=0, description="window policy: longest a request waits for others to join "
                               "its batch (also the adaptive policy's cap).")
    latency_slo_ms: float = Field(200.0, gt=0, description="adaptive policy: p99 latency target the waits must respect.")
    max_queue_size: int = Field(256, ge=1, description="Requests queued per lane before new ones are refused (503).")
    default_timeout_ms: float = Field(30000.0, gt=0, description="Deadline of a request that names none.")
    lanes: list[str] = Field(
        default_factory=lambda: ["high", "normal"], min_length=1,
        description="Priority lanes, highest first; requests name one (default: 'normal', else the last lane).",
    )
    max_consecutive_high: int = Field(
        8, ge=1, description="After this many batches in a row from a higher lane while a lower one waits, "
        "the lower lane gets the next batch (no starvation).",
    )
    reserve_instance_for_high: bool = Field(
        False, description="Keep one instance for the first lane only, so urgent requests never queue behind "
        "running work (needs instances >= 2).",
    )

    @field_validator("lanes")
    @classmethod
    def _lanes_unique(cls, lanes: list[str]) -> list[str]:
        if len(set(lanes)) != len(lanes):
            raise ValueError("lane names must be unique")
        return lanes


class ModelConfig(_Strict):
    """One model of a repository: what to load, how to call it, how to batch it."""

    name: str = Field(description="Model name used in URLs; must match the directory name.")
    version: str = Field("1", description="Version served under /v2/models/{name}/versions/{version}.")
    runtime: RuntimeName = Field(description="Backend that runs the model: onnx, torchscript or pytorch.")
    artifact: str = Field(
        description="Model file relative to the model directory: .onnx, TorchScript .pt, or weights "
        "(.safetensors or a state-dict .pt) for the pytorch runtime."
    )
    factory: str | None = Field(
        None, description="pytorch runtime: 'module:callable' that builds the nn.Module (model directory is importable)."
    )
    factory_kwargs: dict[str, object] = Field(default_factory=dict, description="Keyword arguments for the factory.")
    unsafe_allow_pickle: bool = Field(
        False,
        description="pytorch runtime: allow loading a fully pickled model. Unpickling runs arbitrary code; "
        "only for files you built yourself.",
    )
    inputs: list[TensorSpec] = Field(min_length=1, description="Input tensors (shape without the batch dimension).")
    outputs: list[TensorSpec] = Field(min_length=1, description="Output tensors (shape without the batch dimension).")
    max_batch_size: int = Field(
        16, ge=0, description="Largest batch; 0 means the model takes no batch dimension and runs one request at a time."
    )
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Dynamic batching settings.")
    instances: int = Field(1, ge=1, le=64, description="Worker processes serving this model.")
    device: str = Field("cpu", description="Device of each instance: cpu, cuda or cuda:N.")
    dtype: ServingDtype = Field("fp32", description="Serving dtype of the weights (torch runtimes).")
    threads: int = Field(1, ge=1, le=256, description="Intra-op threads per instance.")
    freeze: bool = Field(False, description="torchscript runtime: torch.jit.freeze the module after loading.")
    optimize_for_inference: bool = Field(
        False, description="torchscript runtime: apply torch.jit.optimize_for_inference (implies freeze)."
    )
    warmup: bool = Field(True, description="Run dummy batches up to max_batch_size before the model is reported ready.")
    dtype_tolerance: float = Field(
        0.05, gt=0, description="dtype auto: largest relative difference from fp32 outputs on the warm-up batch "
        "that still allows reduced precision (bf16/fp16); above it the model serves in fp32.",
    )
    lazy_submodules: list[str] = Field(
        default_factory=list, description="pytorch runtime: submodules (dotted names) whose weights load on first "
        "use instead of at start (at most once, even under concurrency).",
    )
    memory_limit_bytes: int | None = Field(
        None, ge=1, description="Memory one instance may use: host RSS, checked after every batch and each "
        "second (above it the worker is drained and replaced); warm-up lowers the effective max batch size to "
        "stay below it (device bytes on CUDA).",
    )
    gpu_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="CUDA devices: hard cap on this instance's share of device memory "
        "(torch.cuda.set_per_process_memory_fraction).",
    )
    spin_wait: bool | None = Field(
        None, description="onnx runtime: let idle intra-op threads spin between batches (lower latency, burns CPU); "
        "default: only when instances x threads leave a core free.",
    )
    nice: int = Field(
        5, ge=0, le=19, description="CPU niceness added to the worker process, so the frontend (admission, "
        "refusals, decoding, urgent routing) keeps the CPU it needs while models saturate the cores.",
    )
    cpu_affinity: list[int] | None = Field(None, description="CPU cores the instance's process may run on.")
    allocator: Literal["system", "jemalloc"] = Field(
        "system", description="Memory allocator of the worker process; jemalloc is used when libjemalloc is installed.",
    )
    preprocess: ImagePreprocess | None = Field(None, description="Image decoding for /predict and BYTES inputs.")
    postprocess: ClassifyPostprocess | None = Field(None, description="Label decoding for /predict.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Free-form facts shown in model metadata.")

    @field_validator("name")
    @classmethod
    def _name_is_url_safe(cls, name: str) -> str:
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError("use letters, digits, '-', '_' or '.'")
        return name

    @field_validator("device")
    @classmethod
    def _device_known(cls, device: str) -> str:
        if device == "cpu" or device == "cuda":
            return device
        if device.startswith("cuda:") and device[5:].isdigit():
            return device
        raise ValueError("use cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _runtime_fields_consistent(self) -> "ModelConfig":
        if self.runtime == "pytorch" and not self.factory:
            raise ValueError("runtime pytorch needs 'factory: module:callable'")
        if self.factory and ":" not in self.factory:
            raise ValueError("factory must look like 'module:callable'")
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError("input names must be unique")
        if self.preprocess is not None:
            target = self.preprocess.input or (names[0] if len(names) == 1 else None)
            if target not in names:
                raise ValueError("preprocess.input must name one of the inputs when the model has several")
        if self.batching.reserve_instance_for_high and self.instances < 2:
            raise ValueError("batching.reserve_instance_for_high needs instances >= 2")
        if self.postprocess is not None and self.postprocess.output is not None:
            if self.postprocess.output not in [t.name for t in self.outputs]:
                raise ValueError("postprocess.output must name one of the outputs")
        return self

    def input_spec(self, name: str) -> TensorSpec | None:
        """The input called `name`, or None."""
        return next((t for t in self.inputs if t.name == name), None)

    @property
    def image_input(self) -> str | None:
        """Name of the input fed by image preprocessing, if the model has one."""
        if self.preprocess is None:
            return None
        return self.preprocess.input or self.inputs[0].name
