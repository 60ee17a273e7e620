"""Typed configuration of one model in a model repository (`<repo>/<name>/model.yaml`).

Every field carries a one-line description; `servewell models` and the README reuse it.
Unknown keys are rejected so that a typo is reported instead of silently ignored. Settings of
one runtime live in the section named after it (`onnx:`, `torchscript:`, `pytorch:`, `python:`):
which runtimes there are, and the class of each one's section, is the runtime registry's
(config/runtimes.py); the flat keys the sections replaced are refused with the place they moved to.

Everything that can be checked from the file alone is checked here, when the config loads, and
every problem is reported with its field: the server never learns a config mistake from a
request, and `servewell models` shows them all at once.
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from servewell.config.batching import BatchingConfig, BatchingPatch
from servewell.config.cache import ResponseCacheConfig
from servewell.config.generate import GenerateSettings, TextSettings, generate_problems
from servewell.config.pipeline import PipelineSpec
from servewell.config.problems import Problems, config_error
from servewell.config.processing import ClassifyPostprocess, ImagePreprocess
from servewell.config.rollout import RolloutConfig, check_traffic
from servewell.config.runtime_sections import (
    MOVED_TO_SECTIONS,
    OnnxSettings,
    PythonSettings,
    PyTorchSettings,
    ServingDtype,
    TorchScriptSettings,
    TorchSettings,
)
from servewell.config.runtimes import (
    RuntimeDescriptor,
    RuntimeName,
    find_runtime,
    resolve,
    runtime_descriptor,
    runtimes,
    runtimes_text,
    runtimes_with,
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
    """One model of a repository: what to load, how to call it, how to batch it.

    The settings section of its runtime (`onnx:`, `pytorch:`, ...) is not a field of this class:
    which runtimes there are is the registry's (config/runtimes.py), so `_sections_in_place` checks
    the section with the class its runtime's descriptor names and keeps it as an extra (read it
    with `runtime_settings`, or `onnx`, `torchscript`, `pytorch`, `python`); every other unknown
    key is refused there, as `StrictModel` refuses them."""

    model_config = ConfigDict(extra="allow", frozen=True)
    _runtime: RuntimeDescriptor | None = PrivateAttr(None)

    name: str = Field(description="Model name used in URLs; must match the directory name.")
    version: str = Field("1", description="Version served under /v2/models/{name}/versions/{version}.")
    kind: Literal["model", "pipeline"] = Field(
        "model", description="model: one artifact run by a runtime; pipeline: steps that are other served models "
        "(the `pipeline:` section), with no artifact nor runtime of its own.",
    )
    runtime: RuntimeName = Field(description="Backend that runs the model: " + runtimes_text()[len("use "):] +
                                 " (a pipeline's is 'pipeline', set for it).")
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
        """Check the runtime's section with the class its descriptor names (its defaults where it may
        be left out), and refuse a section of another runtime, an unknown key, and a flat key that
        moved into a section (naming where it went), together with every other problem."""
        if not isinstance(data, dict):
            return handler(data)
        problems = Problems(cls.__name__)
        rest = dict(data)
        if rest.get("kind") == "pipeline":
            for key in ("runtime", "artifact"):
                if key in rest:
                    problems.add((key,), "a pipeline has none: its steps are served models (remove it)", rest[key])
            rest["runtime"], rest["artifact"] = "pipeline", PIPELINE_ARTIFACT
        runtime = rest.get("runtime")
        sections = _runtime_sections(rest, runtime, problems)
        for key in [key for key in rest if key not in cls.model_fields and key != DEPRECATED_HOST_LIMIT]:
            value = rest.pop(key)
            if key in MOVED_TO_SECTIONS:
                problems.add((key,), _moved_field_reason(key, runtime), value)
            elif find_runtime(key) is None:
                problems.add((key,), "Extra inputs are not permitted", value)
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
        try:
            config = handler({**rest, **sections})  # the sections become extras, already validated
        except ValidationError as exc:
            problems.extend(exc)
            problems.raise_if_any()
            raise
        problems.raise_if_any()
        return config

    @field_validator("runtime")
    @classmethod
    def _runtime_registered(cls, runtime: str) -> str:
        if find_runtime(runtime) is None:
            raise config_error(f"unknown runtime {runtime!r}; {runtimes_text()}")
        return runtime

    @classmethod
    def section_fields(cls) -> dict[str, FieldInfo]:
        """The runtime sections as fields, for the reference (scripts/docs_reference.py): one per
        registered runtime with settings, documented like a field although it is kept as an extra."""
        fields = {}
        for runtime in runtimes():
            if runtime.section is not None:
                needs = f"; it needs this section, {runtime.needs_section}" if runtime.needs_section else ""
                fields[runtime.name] = FieldInfo(
                    annotation=runtime.section | None, default=None,  # type: ignore[arg-type]  # a class | None
                    description=f"Settings of runtime {runtime.name}, where {runtime.summary}{needs} (only "
                    f"with runtime: {runtime.name}).")
        return fields

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
        # The descriptor as this process's registry has it now: kept with the config, so that a worker
        # it is pickled to knows a runtime registered in this process only.
        self._runtime = runtime_descriptor(self.runtime)
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
        check = self.runtime_descriptor.model_check
        if check:
            for where, reason in resolve(check)(self):
                problems.add(where, reason)
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
    def runtime_descriptor(self) -> RuntimeDescriptor:
        """This model's runtime (config/runtimes.py), as the registry had it when the config was
        validated: a worker started for the model knows it even if only the engine registered it."""
        return self._runtime if self._runtime is not None else runtime_descriptor(self.runtime)

    @property
    def runtime_settings(self) -> StrictModel | None:
        """The section of this model's runtime (its defaults where it was left out); None for a
        runtime without settings."""
        section = (self.__pydantic_extra__ or {}).get(self.runtime)
        return section if isinstance(section, StrictModel) else None

    @property
    def onnx(self) -> OnnxSettings | None:
        """The `onnx:` section of an onnx model (None for another runtime)."""
        section = self.runtime_settings
        return section if self.runtime == "onnx" and isinstance(section, OnnxSettings) else None

    @property
    def torchscript(self) -> TorchScriptSettings | None:
        """The `torchscript:` section of a torchscript model (None for another runtime)."""
        section = self.runtime_settings
        return section if self.runtime == "torchscript" and isinstance(section, TorchScriptSettings) else None

    @property
    def pytorch(self) -> PyTorchSettings | None:
        """The `pytorch:` section of a pytorch model (None for another runtime)."""
        section = self.runtime_settings
        return section if self.runtime == "pytorch" and isinstance(section, PyTorchSettings) else None

    @property
    def python(self) -> PythonSettings | None:
        """The `python:` section of a python model (None for another runtime)."""
        section = self.runtime_settings
        return section if self.runtime == "python" and isinstance(section, PythonSettings) else None

    @property
    def torch_settings(self) -> TorchSettings | None:
        """The section of a torch runtime (dtype, dtype_tolerance, gpu_memory_fraction); None for others."""
        section = self.runtime_settings
        return section if isinstance(section, TorchSettings) else None

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


def _runtime_sections(data: dict[str, Any], runtime: object, problems: Problems) -> dict[str, StrictModel]:
    """The section of `runtime` in model.yaml's `data`, checked with its registered class (its
    defaults where it may be left out); a section of another registered runtime is a problem. An
    empty section (`onnx:` with nothing under it) is no section."""
    sections: dict[str, StrictModel] = {}
    for key, value in data.items():
        owner = find_runtime(key)
        if owner is None or owner.section is None or value is None:
            continue
        if key != runtime:
            whose = f"this model's runtime is {runtime}" if isinstance(runtime, str) else "not this model's runtime"
            problems.add((key,), f"settings of runtime {key}; {whose} (remove the section or change runtime)")
            continue
        try:
            sections[key] = owner.section.model_validate(value)
        except ValidationError as exc:
            problems.extend(exc, (key,))
    descriptor = find_runtime(runtime)
    if descriptor is not None and descriptor.section is not None and data.get(descriptor.name) is None:
        if descriptor.needs_section:
            problems.add((descriptor.name,),
                         f"runtime {descriptor.name} needs this section, {descriptor.needs_section}")
        else:
            sections[descriptor.name] = descriptor.section()
    return sections


def _moved_field_reason(field: str, runtime: object) -> str:
    """Why the flat key `field` is refused: where it lives now, for this model's `runtime`."""
    owners = runtimes_with(field)
    if runtime in owners:
        return f"moved to '{runtime}.{field}'"
    places = " or ".join(f"'{owner}.{field}'" for owner in owners)
    known = isinstance(runtime, str) and find_runtime(runtime) is not None
    runtime_note = f"; this model's runtime is {runtime}" if known else ""
    return f"moved to {places} (a setting of the {' and '.join(owners)} runtime{'s' if len(owners) > 1 else ''} only" \
        f"{runtime_note})"
