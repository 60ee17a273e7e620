"""Typed configuration of one model in a model repository (`<repo>/<name>/model.yaml`).

Every field carries a one-line description; `servewell models` and the README reuse it.
Unknown keys are rejected so that a typo is reported instead of silently ignored. Settings of
one runtime live in the section named after it (`onnx:`, `torchscript:`, `pytorch:`, see
`runtime_sections`); the flat keys they replaced are refused with the place they moved to.

Everything that can be checked from the file alone is checked here, when the config loads, and
every problem is reported with its field: the server never learns a config mistake from a
request, and `servewell models` shows them all at once.
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, ValidationError, field_validator, model_validator

from servewell.config.batching import BatchingConfig, BatchingPatch
from servewell.config.cache import ResponseCacheConfig
from servewell.config.generate import GenerateSettings, TextSettings, generate_problems
from servewell.config.pipeline import PipelineSpec
from servewell.config.problems import Problems, config_error
from servewell.config.processing import ClassifyPostprocess, ImagePreprocess
from servewell.config.rollout import RolloutConfig, check_traffic
from servewell.config.runtime_sections import (
    MOVED_TO_SECTIONS,
    RUNTIMES,
    OnnxSettings,
    PythonSettings,
    PyTorchSettings,
    RuntimeName,
    ServingDtype,
    TorchScriptSettings,
    TorchSettings,
    entry_module_problem,
    moved_field_reason,
)
from servewell.config.strict import StrictModel
from servewell.config.tensors import NUMPY_TO_OIP, OIP_TO_NUMPY, Datatype, TensorSpec

__all__ = [
    "NUMPY_TO_OIP", "OIP_TO_NUMPY", "BatchingConfig", "BatchingPatch", "ClassifyPostprocess", "Datatype",
    "ImagePreprocess", "ModelConfig", "OnnxSettings", "PyTorchSettings", "RuntimeName", "ServingDtype",
    "TensorSpec", "TorchScriptSettings", "TorchSettings",
]

log = logging.getLogger("servewell.config")

#: The old name of `host_memory_limit_bytes`, still read (with a warning in the log): it meant host
#: memory for recycling but device memory for warm-up on CUDA, now two settings.
DEPRECATED_HOST_LIMIT = "memory_limit_bytes"
#: Runtimes whose section may be left out (every setting in it has a default).
_OPTIONAL_SECTIONS = ("onnx", "torchscript")
#: Entries of `extra_files`, and characters of one: a list, not a second repository.
MAX_EXTRA_FILES = 256
MAX_EXTRA_FILE_CHARS = 1000
#: A pipeline's `artifact`: it has no model file, and its model.yaml is the file it is made of.
PIPELINE_ARTIFACT = "model.yaml"
#: Artifact suffix that holds weights only, which only the pytorch runtime can load.
_WEIGHTS_ONLY_SUFFIX = ".safetensors"


def is_pattern(entry: str) -> bool:
    """Whether an `extra_files` entry is a glob (which may match nothing) rather than a name."""
    return any(c in entry for c in "*?[")


def _inside_model_directory(entry: str) -> bool:
    """Whether a path from model.yaml (`artifact`, `extra_files`) stays inside the model directory."""
    path = PurePosixPath(entry)
    return bool(entry) and not path.is_absolute() and ".." not in path.parts and "\\" not in entry \
        and "\x00" not in entry


class ModelConfig(StrictModel):
    """One model of a repository: what to load, how to call it, how to batch it."""

    name: str = Field(description="Model name used in URLs; must match the directory name.")
    version: str = Field("1", description="Version served under /v2/models/{name}/versions/{version}.")
    kind: Literal["model", "pipeline"] = Field(
        "model", description="model: one artifact run by a runtime; pipeline: steps that are other served models "
        "(the `pipeline:` section), with no artifact nor runtime of its own.",
    )
    runtime: RuntimeName = Field(description="Backend that runs the model: onnx, torchscript, pytorch or python "
                                 "(a pipeline's is 'pipeline', set for it).")
    artifact: str = Field(
        description="Model file relative to the model directory: .onnx, TorchScript .pt, weights "
        "(.safetensors or a state-dict .pt) for the pytorch runtime, the module's .py file for the python runtime "
        "(a pipeline's is its model.yaml, set for it)."
    )
    extra_files: list[str] = Field(
        default_factory=list, max_length=MAX_EXTRA_FILES,
        description="Other files the model reads (labels, tokenizer, a JSON the factory opens), relative to the "
        "model directory; globs and whole directories allowed. The snapshot copies only the artifact, its ONNX "
        "external data, model.yaml, the *.py files of a pytorch or python model and these.",
    )
    inputs: list[TensorSpec] = Field(min_length=1, description="Input tensors (shape without the batch dimension).")
    outputs: list[TensorSpec] = Field(min_length=1, description="Output tensors (shape without the batch dimension).")
    max_batch_size: int = Field(
        16, ge=0,
        description="Largest batch; 0 means the model takes no batch dimension and runs one request at a time.",
    )
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Dynamic batching settings.")
    max_output_bytes: int | None = Field(
        None, ge=1, description="Largest answer to one request, all its outputs together, in bytes: a larger one is "
        "refused in the worker before it is copied anywhere (500 output_too_large, naming both sizes); unset: the "
        "server's max_output_bytes.",
    )
    instances: int = Field(1, ge=1, le=64, description="Worker processes serving this model.")
    pinned: bool = Field(False, description="Never evicted to make room for another model; in lazy mode it "
                         "loads at start.")
    idle_unload_s: float | None = Field(
        None, ge=0, description="Unload after this many seconds without a request (0: never; unset: the server's "
        "idle_unload_s).",
    )

    device: str = Field("cpu", description="Device of each instance: cpu, cuda or cuda:N.")
    threads: int = Field(1, ge=1, le=256, description="Intra-op threads per instance.")
    warmup: bool = Field(True, description="Run dummy batches up to max_batch_size before the model is reported ready.")
    host_memory_limit_bytes: int | None = Field(
        None, ge=1, description="Host memory (resident set) one instance may use, checked after every batch and "
        "each second: above it the worker is drained and replaced. On a CPU device warm-up also lowers the "
        "effective max batch size to stay below it. Formerly memory_limit_bytes (still read, deprecated).",
    )
    device_memory_limit_bytes: int | None = Field(
        None, ge=1, description="CUDA devices only: device memory one instance may use. A torch runtime caps "
        "the process's share of the device at it (set_per_process_memory_fraction) and its warm-up lowers the "
        "effective max batch size to stay below it; onnxruntime caps its CUDA arena (gpu_mem_limit).",
    )
    nice: int = Field(
        5, ge=0, le=19, description="CPU niceness added to the worker process, so the frontend (admission, "
        "refusals, decoding, urgent routing) keeps the CPU it needs while models saturate the cores.",
    )
    cpu_policy: Literal["normal", "idle"] = Field(
        "normal", description="idle: the instances run under Linux's SCHED_IDLE, on CPU time nothing else wants "
        "(a woken serving process preempts them at once); for background work. A version that only shadows "
        "traffic gets it.",
    )
    cpu_affinity: list[int] | list[list[int]] | None = Field(
        None, description="CPU cores the instances may run on: one list for every instance ([0, 1]), or one list "
        "per instance ([[0], [1]] pins instance 0 to core 0 and instance 1 to core 1).",
    )
    allocator: Literal["system", "jemalloc"] = Field(
        "system", description="Memory allocator of the worker process; jemalloc is used when libjemalloc is installed.",
    )
    onnx: OnnxSettings | None = Field(None, description="Settings of runtime onnx (only with runtime: onnx).")
    torchscript: TorchScriptSettings | None = Field(
        None, description="Settings of runtime torchscript (only with runtime: torchscript)."
    )
    pytorch: PyTorchSettings | None = Field(
        None, description="Settings of runtime pytorch, which needs at least 'factory' (only with runtime: pytorch)."
    )
    python: PythonSettings | None = Field(
        None, description="Settings of runtime python, which needs at least 'entry: module:Class' (only with "
        "runtime: python)."
    )
    pipeline: PipelineSpec | None = Field(None, description="The steps of a pipeline (only with kind: pipeline).")
    preprocess: ImagePreprocess | None = Field(None, description="Image decoding for /predict and BYTES inputs.")
    postprocess: ClassifyPostprocess | None = Field(None, description="Label decoding for /predict.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Free-form facts shown in model metadata.")
    deterministic: bool = Field(True, description="Whether the same inputs always give the same outputs; a model "
                                "declared false (sampling, dropout at inference) is never cached.")
    cache: ResponseCacheConfig | None = Field(None, description="Answer repeated inputs from a cache in the engine, "
                                              "and share one computation among identical requests in flight.")
    traffic: dict[str, float] | None = Field(
        None, description="Weights of the versions that share this model's requests, e.g. {\"1\": 95, \"2\": 5}: "
        "this model.yaml's version and others under versions/<v>/ (each with its own model.yaml); unset: this "
        "version takes everything. A version asked for in the request's path still wins.")
    rollout: RolloutConfig | None = Field(None, description="Stickiness, shadow traffic and the automatic rollback "
                                          "rules of the traffic split.")
    generate: GenerateSettings | None = Field(
        None, description="The model answers in parts (a step-wise or generator python model): its sequences run "
        "with continuous batching (engine/sequences.py) and stream over SSE, gRPC and the OpenAI-compatible API.")
    text: TextSettings | None = Field(None, description="The UINT8 tensors that carry UTF-8 text, for OIP generate "
                                      "and the OpenAI-compatible API.")

    @model_validator(mode="wrap")
    @classmethod
    def _sections_in_place(cls, data: Any, handler: ModelWrapValidatorHandler[ModelConfig]) -> ModelConfig:
        """Refuse the flat keys that moved into a runtime section, naming where each went, together
        with every other problem; give onnx and torchscript models their (optional) section."""
        if not isinstance(data, dict):
            return handler(data)
        runtime = data.get("runtime")
        moved = [key for key in data if key in MOVED_TO_SECTIONS]
        rest = {key: value for key, value in data.items() if key not in moved}
        problems = Problems(cls.__name__)
        if DEPRECATED_HOST_LIMIT in rest:
            if "host_memory_limit_bytes" in rest:
                problems.add((DEPRECATED_HOST_LIMIT,), "is the deprecated name of host_memory_limit_bytes, which is "
                             "given too; keep host_memory_limit_bytes only", rest[DEPRECATED_HOST_LIMIT])
                del rest[DEPRECATED_HOST_LIMIT]
            else:
                log.warning("model %s: %s is deprecated; it means host_memory_limit_bytes (resident memory of a "
                            "worker; device memory is device_memory_limit_bytes): rename it in model.yaml",
                            data.get("name", "?"), DEPRECATED_HOST_LIMIT)
                rest["host_memory_limit_bytes"] = rest.pop(DEPRECATED_HOST_LIMIT)
        if runtime in _OPTIONAL_SECTIONS and rest.get(runtime) is None:
            rest[runtime] = {}
        if rest.get("kind") == "pipeline":
            for key in ("runtime", "artifact"):
                if key in rest:
                    problems.add((key,), "a pipeline has none: its steps are served models (remove it)", rest[key])
            rest["runtime"], rest["artifact"] = "pipeline", PIPELINE_ARTIFACT
        for key in moved:
            problems.add((key,), moved_field_reason(key, runtime), data[key])
        try:
            config = handler(rest)
        except ValidationError as exc:
            problems.extend(exc)
            problems.raise_if_any()
            raise
        problems.raise_if_any()
        return config

    @field_validator("name")
    @classmethod
    def _name_is_url_safe(cls, name: str) -> str:
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise config_error("use letters, digits, '-', '_' or '.'")
        return name

    @field_validator("traffic")
    @classmethod
    def _traffic_weights(cls, traffic: dict[str, float] | None) -> dict[str, float] | None:
        return None if traffic is None else check_traffic(traffic)

    @field_validator("device")
    @classmethod
    def _device_known(cls, device: str) -> str:
        if device == "cpu" or device == "cuda":
            return device
        if device.startswith("cuda:") and device[5:].isdigit():
            return device
        raise config_error("use cpu, cuda or cuda:N")

    @field_validator("artifact")
    @classmethod
    def _artifact_inside_model_directory(cls, artifact: str) -> str:
        if not _inside_model_directory(artifact):
            raise config_error(f"{artifact!r} must be a file name relative to the model directory, without '..'")
        return artifact

    @field_validator("extra_files")
    @classmethod
    def _extra_files_inside_model_directory(cls, entries: list[str]) -> list[str]:
        problems = Problems(cls.__name__)
        for index, entry in enumerate(entries):
            if len(entry) > MAX_EXTRA_FILE_CHARS:
                problems.add((index,), f"is {len(entry)} characters long; at most {MAX_EXTRA_FILE_CHARS}")
            elif not _inside_model_directory(entry):
                problems.add((index,), f"{entry!r} must be a path or pattern relative to the model directory, "
                             "without '..'", entry)
        problems.raise_if_any()
        return entries

    @field_validator("cpu_affinity", mode="before")
    @classmethod
    def _affinity_shape(cls, value: Any) -> Any:
        if value is None:
            return value
        problems = Problems(cls.__name__)
        how = "give CPU numbers for every instance ([0, 1]) or one list per instance ([[0], [1]])"
        if not isinstance(value, list) or not value:
            problems.add((), f"{how}; leave cpu_affinity out to let the OS place the instances", value)
        elif all(isinstance(item, list) for item in value):
            for index, cpus in enumerate(value):
                _check_cpus(cpus, (index,), problems)
        elif any(isinstance(item, list) for item in value):
            problems.add((), f"mixes numbers and lists; {how}", value)
        else:
            _check_cpus(value, (), problems)
        problems.raise_if_any()
        return value

    @model_validator(mode="after")
    def _fits_together(self) -> ModelConfig:
        problems = Problems(type(self).__name__)
        self._check_sections(problems)
        for group in ("inputs", "outputs"):
            names = [spec.name for spec in getattr(self, group)]
            for index, name in enumerate(names):
                if names.index(name) != index:
                    problems.add((group, index, "name"), f"{group[:-1]} name {name!r} is used twice")
        if self.pipeline is not None:
            self._check_pipeline(self.pipeline, problems)
        if self.preprocess is not None:
            self._check_preprocess(self.preprocess, problems)
        if self.postprocess is not None:
            self._check_postprocess(self.postprocess, problems)
        if self.cache is not None and not self.deterministic:
            problems.add(("cache",), "a model declared non-deterministic (deterministic: false) is never cached; "
                         "remove cache or declare the model deterministic")
        if self.kind == "pipeline" and (self.traffic is not None or self.rollout is not None):
            problems.add(("traffic",), "a pipeline has one version; split the traffic of its step models instead")
        if self.rollout is not None and self.rollout.shadow is not None and self.rollout.shadow.version == self.version:
            problems.add(("rollout", "shadow", "version"), f"is this model.yaml's own version {self.version!r}; a "
                         "shadow is another version (under versions/<v>/)")
        if self.batching.reserve_instance_for_high and self.instances < 2:
            problems.add(("batching", "reserve_instance_for_high"),
                         f"needs instances >= 2; instances is {self.instances}")
        if self.cpu_affinity and isinstance(self.cpu_affinity[0], list) and len(self.cpu_affinity) != self.instances:
            problems.add(("cpu_affinity",), f"has {len(self.cpu_affinity)} per-instance lists; instances is "
                         f"{self.instances}, so give one list per instance (or one flat list for every instance)")
        for where, reason in generate_problems(self):
            problems.add(where, reason)
        problems.raise_if_any()
        return self

    def _check_sections(self, problems: Problems) -> None:
        if (self.kind == "pipeline") != (self.runtime == "pipeline"):
            problems.add(("runtime",), "runtime pipeline is for a model.yaml of kind: pipeline (and it sets it)")
        if (self.kind == "pipeline") != (self.pipeline is not None):
            problems.add(("pipeline",), "kind: pipeline needs this section (steps and outputs)" if self.pipeline is None
                         else "a pipeline section needs kind: pipeline")
        if self.runtime == "python" and self.python is None:
            problems.add(("python",), "runtime python needs this section, with at least 'entry: module:Class'")
        elif self.runtime == "python" and self.python is not None:
            mismatch = entry_module_problem(self.python.entry, self.artifact)
            if mismatch is not None:
                problems.add(("python", "entry"), mismatch)
            for group in ("inputs", "outputs"):
                for index, spec in enumerate(getattr(self, group)):
                    if spec.datatype == "BYTES":
                        problems.add((group, index, "datatype"), f"{group[:-1]} {spec.name!r} is BYTES: a python "
                                     "model takes and returns numeric and BOOL tensors (a batch crosses to its "
                                     "worker in shared memory, which cannot hold Python objects)")
        for section in RUNTIMES:
            if section != self.runtime and getattr(self, section) is not None:
                problems.add((section,), f"settings of runtime {section}; this model's runtime is {self.runtime} "
                             f"(remove the section or change runtime)")
        if self.runtime == "pytorch" and self.pytorch is None:
            problems.add(("pytorch",), "runtime pytorch needs this section, with at least 'factory: module:callable'")
        if self.runtime != "pytorch" and self.artifact.endswith(_WEIGHTS_ONLY_SUFFIX):
            problems.add(("artifact",), f"a {_WEIGHTS_ONLY_SUFFIX} file holds weights only; it needs runtime pytorch "
                         "and a factory that builds the module")
        torch = self.torch_settings
        if torch is not None and torch.gpu_memory_fraction is not None and not self.device.startswith("cuda"):
            problems.add((self.runtime, "gpu_memory_fraction"), f"applies to CUDA devices; device is {self.device}")
        if self.device_memory_limit_bytes is not None:
            if not self.device.startswith("cuda"):
                problems.add(("device_memory_limit_bytes",), f"applies to CUDA devices; device is {self.device} "
                             "(host memory is host_memory_limit_bytes)")
            elif torch is not None and torch.gpu_memory_fraction is not None:
                problems.add(("device_memory_limit_bytes",), f"and {self.runtime}.gpu_memory_fraction both cap "
                             "device memory; give one of them")

    def _check_pipeline(self, spec: PipelineSpec, problems: Problems) -> None:
        """Its sources name declared inputs, and its outputs are exactly the declared ones."""
        inputs = [t.name for t in self.inputs]
        for index, step in enumerate(spec.steps):
            sources = [(("inputs", target), source) for target, source in step.inputs.items()]
            if step.when is not None:
                sources.append((("when", "tensor"), step.when.tensor))
            for where, source in sources:
                if "." not in source and source not in inputs:
                    problems.add(("pipeline", "steps", index, *where), f"{source!r} is not an input of the pipeline "
                                 f"(its inputs are {inputs})", source)
        declared = [t.name for t in self.outputs]
        for name in spec.outputs:
            if name not in declared:
                problems.add(("pipeline", "outputs", name), f"is not a declared output (outputs are {declared})")
        for name in declared:
            if name not in spec.outputs:
                problems.add(("pipeline", "outputs"), f"declared output {name!r} has no source here")
        if self.cache is not None:
            problems.add(("cache",), "a pipeline has no cache of its own; give its step models one")

    def _check_preprocess(self, spec: ImagePreprocess, problems: Problems) -> None:
        names = [t.name for t in self.inputs]
        target = spec.input or (names[0] if len(names) == 1 else None)
        tensor = self.input_spec(target) if target is not None else None
        if tensor is None:
            problems.add(("preprocess", "input"), f"must name one of the inputs {names}" if spec.input is not None
                         else f"the model has inputs {names}; name the one the image feeds")
            return
        if tensor.datatype in ("BYTES", "BOOL"):
            # Decoded images are cast to the input's dtype (FP16 and UINT8 inputs work); these cannot hold them.
            problems.add(("preprocess",), f"produces pixel values, which input {tensor.name!r} "
                         f"({tensor.datatype}) cannot hold")
        produced = spec.tensor_shape
        fits = len(tensor.shape) == len(produced) and all(
            d in (-1, p) for d, p in zip(tensor.shape, produced, strict=True))
        if not fits:
            problems.add(("preprocess",), f"produces images of shape {produced} (layout {spec.layout}: channels "
                         f"{spec.channels}, size {list(spec.size)}), but input {tensor.name!r} declares {tensor.shape}")

    def _check_postprocess(self, post: ClassifyPostprocess, problems: Problems) -> None:
        names = [t.name for t in self.outputs]
        if post.output is not None and post.output not in names:
            problems.add(("postprocess", "output"), f"must name one of the outputs {names}")
            return
        scores = next(t for t in self.outputs if t.name == (post.output or names[0]))
        if scores.datatype in ("BYTES", "BOOL"):
            problems.add(("postprocess", "output"), f"output {scores.name!r} is {scores.datatype}, not scores")
        size = scores.fixed_size
        if post.labels is not None and size is not None and len(post.labels) != size:
            problems.add(("postprocess", "labels"), f"has {len(post.labels)} labels, but output {scores.name!r} "
                         f"holds {size} scores per item (shape {scores.shape})")

    def input_spec(self, name: str) -> TensorSpec | None:
        """The input called `name`, or None."""
        return next((t for t in self.inputs if t.name == name), None)

    @property
    def other_versions(self) -> set[str]:
        """The versions under versions/<v>/ that `traffic` or `rollout.shadow` name (not this one)."""
        wanted = set(self.traffic or ())
        if self.rollout is not None and self.rollout.shadow is not None:
            wanted.add(self.rollout.shadow.version)
        wanted.discard(self.version)
        return wanted

    @property
    def image_input(self) -> str | None:
        """Name of the input fed by image preprocessing, if the model has one."""
        if self.preprocess is None:
            return None
        return self.preprocess.input or self.inputs[0].name

    @property
    def torch_settings(self) -> TorchSettings | None:
        """The section of a torch runtime (dtype, dtype_tolerance, gpu_memory_fraction); None for onnx."""
        if self.runtime == "torchscript":
            return self.torchscript or TorchScriptSettings()
        if self.runtime == "pytorch":
            return self.pytorch
        return None

    def affinity_of(self, instance: int) -> list[int] | None:
        """CPUs instance `instance` may run on, or None to let the OS place it."""
        if not self.cpu_affinity:
            return None
        per_instance = [cpus for cpus in self.cpu_affinity if isinstance(cpus, list)]
        if per_instance:
            return list(per_instance[instance])
        return [cpu for cpu in self.cpu_affinity if isinstance(cpu, int)]


def _check_cpus(cpus: Any, location: tuple[str | int, ...], problems: Problems) -> None:
    if not isinstance(cpus, list) or not cpus:
        problems.add(location, "an instance needs at least one CPU", cpus)
        return
    for index, cpu in enumerate(cpus):
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            problems.add(location + (index,), f"{cpu!r} is not a CPU number (0, 1, ...)", cpu)
        elif cpus.index(cpu) != index:
            problems.add(location + (index,), f"CPU {cpu} is listed twice", cpu)
