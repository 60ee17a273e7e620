"""Per-runtime sections of model.yaml: `onnx:`, `torchscript:`, `pytorch:`, `python:` (each runtime's
descriptor in config/runtimes.py names its section class).

Each section holds every knob its runtime has, so a model.yaml shows at a glance what applies
to it, and a knob of another runtime is an error instead of being silently ignored. The serving
precision (`dtype`, `dtype_tolerance`) and the CUDA memory cap belong to the two torch runtimes
only (an ONNX graph computes in the dtypes it was exported with), so both torch sections
inherit them from `TorchSettings` rather than sharing a fourth section: one model, one section.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import Field, field_validator

from servewell.config.problems import Location, Problems, config_error
from servewell.config.strict import StrictModel

ServingDtype = Literal["fp32", "fp16", "bf16", "auto"]


class OnnxSettings(StrictModel):
    """Settings of the onnx runtime (onnxruntime)."""

    spin_wait: bool | None = Field(
        None, description="Let idle intra-op threads spin between batches (lower latency, burns CPU); "
        "default: only when instances x threads leave a core free (of the machine, at most its container's CPU "
        "limit).",
    )


class TorchSettings(StrictModel):
    """What both torch runtimes (torchscript, pytorch) share: serving precision and the CUDA memory cap."""

    dtype: ServingDtype = Field(
        "fp32", description="Serving dtype of the weights: fp32, fp16, bf16, or auto (fp16 on CUDA, bf16 on a "
        "CPU with native bf16, else fp32; checked against fp32 at warm-up).",
    )
    dtype_tolerance: float = Field(
        0.05, gt=0, description="dtype auto: largest relative difference from fp32 outputs on the warm-up batch "
        "that still allows reduced precision (bf16/fp16); above it the model serves in fp32.",
    )
    gpu_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="CUDA devices only: hard cap on each instance's share of device memory "
        "(torch.cuda.set_per_process_memory_fraction).",
    )


class TorchScriptSettings(TorchSettings):
    """Settings of the torchscript runtime (`torch.jit.load`)."""

    freeze: bool = Field(False, description="torch.jit.freeze the module after loading.")
    optimize_for_inference: bool = Field(
        False, description="Apply torch.jit.optimize_for_inference (implies freeze)."
    )


def _dotted_identifiers(text: str) -> bool:
    """`pkg.mod` or `Cls.build`: Python identifiers joined by dots."""
    return all(part.isidentifier() for part in text.split("."))


def _submodule_path(text: str) -> bool:
    """A dotted submodule name as `get_submodule` takes it; a ModuleList's children are numbers."""
    return all(part.isidentifier() or part.isdigit() for part in text.split("."))


class PyTorchSettings(TorchSettings):
    """Settings of the pytorch runtime: a factory builds the module, the artifact holds its weights."""

    factory: str = Field(
        description="'module:callable' that builds the nn.Module (the model directory is importable)."
    )
    factory_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the factory.")
    unsafe_allow_pickle: bool = Field(
        False, description="Allow loading a fully pickled model. Unpickling runs arbitrary code; only for files "
        "you built yourself.",
    )
    lazy_submodules: list[str] = Field(
        default_factory=list, description="Submodules (dotted names) whose weights load on first use instead of "
        "at start (at most once, even under concurrency); none inside another.",
    )

    @field_validator("factory")
    @classmethod
    def _factory_spec(cls, factory: str) -> str:
        module, colon, attribute = factory.partition(":")
        if not colon or not _dotted_identifiers(module) or not _dotted_identifiers(attribute):
            raise config_error(f"{factory!r} must look like 'module:callable' (e.g. 'my_model:build')")
        return factory

    @field_validator("lazy_submodules")
    @classmethod
    def _lazy_names(cls, names: list[str]) -> list[str]:
        problems = Problems(cls.__name__)
        for index, name in enumerate(names):
            if not name or not _submodule_path(name):
                problems.add((index,), f"{name!r} is not a dotted submodule name such as 'head' or 'blocks.3'", name)
            elif names.index(name) != index:
                problems.add((index,), f"{name!r} is listed twice", name)
        for index, name in enumerate(names):
            outer = next((other for other in names if name.startswith(other + ".")), None)
            if outer is not None:
                problems.add((index,), f"{name!r} is inside {outer!r}, which is lazy already; list only the outer "
                             "one", name)
        problems.raise_if_any()
        return names


class PythonSettings(StrictModel):
    """Settings of the python runtime: a class of the model directory's code runs the batches."""

    entry: str = Field(
        description="'module:Class' in the model directory (the artifact is that module's file): the class is "
        "instantiated without arguments, then setup(config) runs once, execute(inputs) runs each batch of named "
        "numpy arrays and returns named arrays, and teardown() (optional) runs when the worker stops."
    )
    settings: dict[str, Any] = Field(
        default_factory=dict, description="Free-form values handed to setup() as config['settings']."
    )

    @field_validator("entry")
    @classmethod
    def _entry_spec(cls, entry: str) -> str:
        module, colon, attribute = entry.partition(":")
        if not colon or not _dotted_identifiers(module) or not attribute.isidentifier():
            raise config_error(f"{entry!r} must look like 'module:Class' (e.g. 'steps:Cropper')")
        return entry


def entry_module_problem(entry: str, artifact: str) -> str | None:
    """Why a python model's `artifact` and `python.entry` disagree (None: they agree): the artifact
    is the file of the entry's module, `steps.py` for `steps:Cropper`, `pkg/steps.py` for
    `pkg.steps:Cropper`."""
    module = entry.partition(":")[0]
    path = PurePosixPath(artifact)
    expected = "/".join(module.split(".")) + ".py"
    if path.suffix != ".py":
        return (f"the artifact of a python model is the .py file of its entry's module ({expected} for entry "
                f"{entry!r}); {artifact!r} is not a .py file")
    if ".".join(path.with_suffix("").parts) != module:
        return (f"artifact {artifact!r} must be the file of the entry's module: python.entry names module "
                f"{module!r}, whose file is {expected} (the artifact's stem must equal the entry's module); "
                "rename one of them")
    return None


def python_model_problems(config: Any) -> list[tuple[Location, str]]:
    """What model.yaml needs for the python runtime beyond its section (its descriptor's
    `model_check`): the artifact is the entry module's file, and no tensor is BYTES (a batch crosses
    to the worker in shared memory, which cannot hold Python objects)."""
    problems: list[tuple[Location, str]] = []
    if isinstance(config.python, PythonSettings):
        mismatch = entry_module_problem(config.python.entry, config.artifact)
        if mismatch is not None:
            problems.append((("python", "entry"), mismatch))
    for group in ("inputs", "outputs"):
        for index, spec in enumerate(getattr(config, group)):
            if spec.datatype == "BYTES":
                problems.append(((group, index, "datatype"), f"{group[:-1]} {spec.name!r} is BYTES: a python model "
                                 "takes and returns numeric and BOOL tensors (a batch crosses to its worker in shared "
                                 "memory, which cannot hold Python objects)"))
    return problems


#: Flat top-level keys of model.yaml from before the per-runtime sections, now fields of a section
#: (the python runtime came with its section: none of its keys was ever flat).
MOVED_TO_SECTIONS: tuple[str, ...] = tuple(sorted(
    {name for section in (OnnxSettings, TorchScriptSettings, PyTorchSettings) for name in section.model_fields}
))
