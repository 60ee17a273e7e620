"""The runtimes: one descriptor each, registered in one place.

A runtime is what runs a model's batches (onnx, torchscript, pytorch, python), or, for `pipeline`,
the engine itself. Everything servewell knows about one is its `RuntimeDescriptor`, and every
place that needs to know reads it from this registry:

- model.yaml (config/model.py): `runtime:` names a registered runtime; its settings section (the
  key named after it, `onnx:`) is checked with the descriptor's section class, a section of another
  runtime is an error, and `model_check` adds what the runtime needs beyond its section;
- the worker (workers/backends.py, runtimes/__init__.py): imports the `backend` module (and,
  through it, the framework) and calls its `load`; a missing `package` is named with its `extra`;
- the engine: the memory estimate (engine/memory_budget.py: `base_bytes` and `weight_bytes`) and
  the files a snapshot copies (engine/model_files.py: `model_code`, `artifact_files`);
- metadata (api/model_document.py): Triton's platform and backend names;
- `servewell models` (repository_report.py): the pre-flight `check`, run in a child process;
- `servewell tune` (perf/tune_config.py): whether it has a serving dtype (its section's `dtype`).

A descriptor is data. The behaviour it names (the backend, the weight estimate, the check) is a
"module:function" path, imported only by the process that runs it, so importing the registry
imports no framework and nothing of ours outside `config` (the import rule of config), and a
descriptor pickles to a worker as it is. A validated `ModelConfig` keeps its runtime's descriptor
(`ModelConfig.runtime_descriptor`), so a worker started for it knows a runtime that only its
engine's process registered.

Adding a runtime: a backend module with `load(config, model_dir, progress) -> ModelRuntime`
(runtimes/base.py), a section class if it has settings (config/runtime_sections.py), and one
descriptor in `BUILT_IN` below; nothing else changes. `register_runtime` adds one at run time
(tests/integration/workers/test_toy_runtime.py adds a toy runtime that way).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from servewell.config.runtime_sections import OnnxSettings, PythonSettings, PyTorchSettings, TorchScriptSettings
from servewell.config.strict import StrictModel

MiB = 1 << 20
#: A runtime's name: what `runtime:` says in model.yaml, and the key of its settings section.
RuntimeName = str
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True, slots=True)
class RuntimeCheck:
    """A runtime's pre-flight check in `servewell models`: a function run in a child process (it
    may import the framework or the model's own code, which may hang, crash or print).

    `function` is called as `function(config, model_dir)` and returns the problems it found
    (`list[config.problems.FieldProblem]`), or the problems and notes (`tuple[list[FieldProblem],
    list[str]]`)."""

    #: "module:function" of the check.
    function: str
    #: What it checks, as a note names it: "factory" in "factory not checked (--no-factory-check)".
    checks: str
    #: The field a check that could not finish is reported on ("pytorch.factory").
    field: str
    #: What it does, for a check that took too long or crashed ("opening {artifact} with onnxruntime").
    doing: str
    #: The `servewell models` flag that skips it.
    skipped_by: str


@dataclass(frozen=True, slots=True)
class RuntimeDescriptor:
    """Everything servewell knows about one runtime (the module docstring says who reads what)."""

    #: `runtime:` in model.yaml, and the key of its settings section: lower case, digits, '_'.
    name: RuntimeName
    #: One clause: what runs the model, and how ("ONNX Runtime (onnxruntime) runs an .onnx graph").
    summary: str
    #: The module a worker imports for it ("" for a runtime that has no worker: a pipeline); its
    #: `load(config, model_dir, progress)` loads a model (runtimes/base.py `RuntimeLoader`).
    backend: str = ""
    #: Its section of model.yaml (None: it has no settings, and a section named after it is an error).
    section: type[StrictModel] | None = None
    #: What a model of this runtime must write in its section, as the error says ("with at least
    #: 'factory: module:callable'"); "" when the section may be left out (it then holds its defaults).
    needs_section: str = ""
    #: "module:function" called as `function(config)` after the config's own checks: the problems
    #: model.yaml has for this runtime beyond its section, as (location, reason) pairs.
    model_check: str = ""
    #: The Python package its backend imports, named when it cannot be imported ("" : none beyond
    #: what servewell itself needs).
    package: str = ""
    #: The servewell extra that installs `package`.
    extra: str = ""
    #: Resident bytes of one worker before any weights (interpreter, framework, arenas).
    base_bytes: int = 0
    #: "module:function" called as `function(config, model_dir)` -> (weight bytes, how they were
    #: estimated), from the model's files and without a framework; "" : the artifact's size, read
    #: as engine/memory_budget.py does (a safetensors header is read for its tensors).
    weight_bytes: str = ""
    #: Triton's `platform` and `backend` names for a model of this runtime (model metadata and
    #: config; tritonclient and perf_analyzer branch on them).
    triton_platform: str = ""
    triton_backend: str = ""
    #: Its pre-flight check in `servewell models` (None: none).
    check: RuntimeCheck | None = None
    #: Whether the model directory's `*.py` files are the model's code (a factory or an entry class
    #: imports them): a snapshot copies them.
    model_code: bool = False
    #: "module:function" called as `function(artifact_path)` -> the further files the artifact
    #: names, relative to its directory (ONNX external data): a snapshot copies them. "" : none.
    artifact_files: str = ""

    @property
    def in_worker(self) -> bool:
        """Whether a worker process runs its models (a pipeline runs in the engine)."""
        return bool(self.backend)


def resolve(path: str) -> Any:
    """The object a "module:attribute" path names, importing the module (which may import a
    framework: call this only where that may happen)."""
    module, _, attribute = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


BUILT_IN: tuple[RuntimeDescriptor, ...] = (
    RuntimeDescriptor(
        "onnx", "ONNX Runtime (onnxruntime) runs an .onnx graph",
        backend="servewell.runtimes.onnx_runtime", section=OnnxSettings, package="onnxruntime", extra="onnx",
        # Measured here: an onnxruntime worker ~90 MB RSS after import and warm-up of a tiny model.
        base_bytes=120 * MiB, triton_platform="onnxruntime_onnx", triton_backend="onnxruntime",
        check=RuntimeCheck("servewell.runtimes.onnx_check:check_onnx", "graph", "artifact",
                           "opening {artifact} with onnxruntime", "--no-graph-check"),
        artifact_files="servewell.engine.onnx_external_data:external_data_files",
    ),
    RuntimeDescriptor(
        "torchscript", "torch.jit.load runs a TorchScript .pt file",
        backend="servewell.runtimes.torchscript_runtime", section=TorchScriptSettings, package="torch",
        extra="torch",
        # Measured here: a torch worker ~350 MB RSS after import and warm-up of a tiny model.
        base_bytes=400 * MiB,
        # Triton's libtorch backend serves TorchScript as `pytorch_libtorch`; its backend is `pytorch`.
        triton_platform="pytorch_libtorch", triton_backend="pytorch",
    ),
    RuntimeDescriptor(
        "pytorch", "a factory builds the nn.Module, whose weights load from safetensors or a state dict",
        backend="servewell.runtimes.pytorch_runtime", section=PyTorchSettings,
        needs_section="with at least 'factory: module:callable'", package="torch", extra="torch",
        base_bytes=400 * MiB, triton_platform="pytorch", triton_backend="pytorch",
        check=RuntimeCheck("servewell.runtimes.factory_check:check_factory", "factory", "pytorch.factory",
                           "building the module on the meta device", "--no-factory-check"),
        model_code=True,
    ),
    RuntimeDescriptor(
        "python", "a class of the model directory's code runs each batch, numpy arrays in and out",
        backend="servewell.runtimes.python_runtime", section=PythonSettings,
        needs_section="with at least 'entry: module:Class'",
        model_check="servewell.config.runtime_sections:python_model_problems",
        # numpy only, which servewell itself needs: no package to name. Its interpreter with numpy;
        # the model's own imports come on top, unknown until it loads (its warm-up measures them).
        base_bytes=60 * MiB, triton_platform="python", triton_backend="python",
        check=RuntimeCheck("servewell.runtimes.entry_check:check_entry", "entry", "python.entry",
                           "importing {artifact}", "--no-factory-check"),
        model_code=True,
    ),
    RuntimeDescriptor(
        # Set for a model.yaml of kind: pipeline (config/pipeline.py): no worker, no artifact, no memory.
        "pipeline", "the engine runs the steps on other served models",
        triton_platform="ensemble", triton_backend="",
    ),
)

_registry: dict[str, RuntimeDescriptor] = {runtime.name: runtime for runtime in BUILT_IN}


def register_runtime(runtime: RuntimeDescriptor) -> RuntimeDescriptor:
    """Add `runtime` to the registry (the one way in, for a runtime that is not `BUILT_IN`):
    model.yaml accepts `runtime: <name>` and its section from then on, in this process and in the
    workers it starts. Registering the same descriptor again changes nothing; `ValueError` for a
    name that is taken by another descriptor or by a model.yaml field, or a malformed path."""
    from servewell.config.model import ModelConfig  # here: config.model reads this registry

    if not _NAME.match(runtime.name):
        raise ValueError(f"runtime name {runtime.name!r} must be 1-32 lower-case letters, digits or '_', "
                         "starting with a letter (it is a key of model.yaml)")
    if runtime.name in ModelConfig.model_fields:
        raise ValueError(f"runtime name {runtime.name!r} is a field of model.yaml; choose another")
    known = _registry.get(runtime.name)
    if known is not None and known != runtime:
        raise ValueError(f"runtime {runtime.name!r} is registered already, with another descriptor")
    paths = [runtime.model_check, runtime.weight_bytes, runtime.artifact_files,
             runtime.check.function if runtime.check else ""]
    for path in paths:
        if path and not _PATH.match(path):
            raise ValueError(f"runtime {runtime.name!r}: {path!r} is not a 'module:function' path")
    _registry[runtime.name] = runtime
    return runtime


def unregister_runtime(name: RuntimeName) -> None:
    """Remove a runtime `register_runtime` added (a test's, when it ends); built-in ones stay."""
    if any(runtime.name == name for runtime in BUILT_IN):
        raise ValueError(f"runtime {name!r} is built in")
    _registry.pop(name, None)


def find_runtime(name: object) -> RuntimeDescriptor | None:
    """The descriptor of the runtime called `name`, or None."""
    return _registry.get(name) if isinstance(name, str) else None


def runtime_descriptor(name: RuntimeName) -> RuntimeDescriptor:
    """The descriptor of the runtime called `name`; `ValueError` naming the runtimes there are."""
    found = _registry.get(name)
    if found is None:
        raise ValueError(f"unknown runtime {name!r}; {runtimes_text()}")
    return found


def runtimes() -> tuple[RuntimeDescriptor, ...]:
    """Every registered runtime, built-in ones first, in the order they were registered."""
    return tuple(_registry.values())


def runtimes_text() -> str:
    """The runtimes a model.yaml may name, as a message says them."""
    names = [runtime.name for runtime in runtimes() if runtime.in_worker]
    return "use " + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])


def runtimes_with(field: str) -> list[RuntimeName]:
    """The runtimes whose section has `field` (`dtype`: the torch runtimes), in registry order."""
    return [runtime.name for runtime in runtimes()
            if runtime.section is not None and field in runtime.section.model_fields]
