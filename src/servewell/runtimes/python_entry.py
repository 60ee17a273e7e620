"""Import a python model's entry class (`python.entry: module:Class`) from its model directory, alone.

The model directory is imported as a package of its own, with a name no other load in the process
uses (`_servewell_python_<n>_<model>`), and the entry module inside it. So a model's `steps.py`
never meets another model's `steps` (two loads in one process, a reload), never takes the place
of an installed or already imported module of the same name (a worker forked from a spare has
numpy, servewell and onnxruntime imported before it learns its model), and is never taken for
one. Sibling modules import relatively (`from . import helpers`); the directory is not put on
`sys.path`.

Only the import happens here, no instance is made: the runtime (`python_runtime`) builds and sets
up the instance, and `servewell models` (`entry_check`) imports the class to check it exists.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import traceback
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.problems import FieldProblem
from servewell.config.runtime_sections import PythonSettings
from servewell.config.runtime_sections import entry_module_problem as entry_module_problem_of
from servewell.runtimes.base import ModelLoadError

#: Datatypes a python model can neither take nor return (see `config_problems`).
UNSHAREABLE_DATATYPES = ("BYTES",)
#: Numbers the packages of this process: each load gets a package of its own.
_loads = itertools.count(1)
_NOT_IDENTIFIER = re.compile(r"\W")


def python_settings(config: ModelConfig) -> PythonSettings:
    """The `python:` section; a config that passed validation always has one for runtime python."""
    if config.python is None:
        raise ModelLoadError("runtime python needs a 'python' section with 'entry: module:Class'")
    return config.python


def entry_module_problem(config: ModelConfig) -> str | None:
    """Why `artifact` and `python.entry` disagree (None: they agree); model.yaml's own check."""
    return entry_module_problem_of(python_settings(config).entry, config.artifact)


def config_problems(config: ModelConfig) -> list[FieldProblem]:
    """What model.yaml alone tells is wrong for the python runtime: the artifact is not the entry
    module's file, or a tensor is BYTES (a batch crosses between the server and the worker in shared
    memory, which holds numbers, not Python objects)."""
    problems = []
    mismatch = entry_module_problem(config)
    if mismatch is not None:
        problems.append(FieldProblem("python.entry", mismatch))
    for group in ("inputs", "outputs"):
        for index, spec in enumerate(getattr(config, group)):
            if spec.datatype in UNSHAREABLE_DATATYPES:
                problems.append(FieldProblem(
                    f"{group}.{index}.datatype", f"{group[:-1]} {spec.name!r} is {spec.datatype}: a python model takes "
                    "and returns numeric and BOOL tensors (a batch crosses to its worker in shared memory, which "
                    "cannot hold Python objects)"))
    return problems


def import_entry(config: ModelConfig, model_dir: Path) -> tuple[type, str]:
    """The entry class and the name of the package the model directory was imported as (give it to
    `forget_package` when the model closes). `ModelLoadError` saying exactly what is missing or
    what failed, with the file and line where the model's code raised. The caller has checked
    `config_problems`."""
    entry = python_settings(config).entry
    module_name, _, class_name = entry.partition(":")
    package = f"_servewell_python_{next(_loads)}_{_NOT_IDENTIFIER.sub('_', config.name)}"
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations = [str(model_dir)]
    sys.modules[package] = importlib.util.module_from_spec(spec)
    importlib.invalidate_caches()  # the directory may be new to this process's path finders
    try:
        module = importlib.import_module(f"{package}.{module_name}")
    except BaseException as exc:  # a SystemExit in the module's body must not end the worker either
        forget_package(package)
        raise ModelLoadError(f"cannot import {config.artifact}: {describe(exc, model_dir)}"
                             f"{_relative_import_hint(exc, model_dir)}") from exc
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        forget_package(package)
        if found is None:
            classes = sorted(name for name, value in vars(module).items()
                             if isinstance(value, type) and value.__module__ == module.__name__)
            defined = f"; it defines {', '.join(classes)}" if classes else "; it defines no class"
            raise ModelLoadError(f"python.entry {entry!r}: {config.artifact} has no class {class_name!r}{defined}")
        raise ModelLoadError(f"python.entry {entry!r}: {class_name!r} in {config.artifact} is a "
                             f"{type(found).__name__}, not a class")
    if not callable(getattr(found, "execute", None)) and not is_stepwise(found):
        forget_package(package)
        raise ModelLoadError(f"python.entry {entry!r}: class {class_name} has no execute(inputs) method, which "
                             "runs each batch (or, for a step-wise generative model, start(requests) and "
                             "step(states))")
    return found, package


def is_stepwise(cls: type) -> bool:
    """Whether the entry class is a step-wise generative model: `start` and `step` (`end` optional)."""
    return callable(getattr(cls, "start", None)) and callable(getattr(cls, "step", None))


def forget_package(package: str) -> None:
    """Drop a model's package and every module imported inside it from `sys.modules`."""
    for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
        del sys.modules[name]


def describe(exc: BaseException, model_dir: Path) -> str:
    """`Type: message (at file:line)`: the exception and the last line of the model's own code it
    passed through, without the rest of the traceback (no line when it passed through none: a
    SyntaxError names its own, importlib's lines would tell the author nothing)."""
    message = message_of(exc)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    root = model_dir.resolve()
    own = [frame for frame in traceback.extract_tb(exc.__traceback__)
           if Path(frame.filename).resolve().is_relative_to(root)]
    if not own:
        return text
    return f"{text} (at {Path(own[-1].filename).resolve().relative_to(root).as_posix()}:{own[-1].lineno})"


def message_of(exc: BaseException) -> str:
    """`str(exc)`, or "" when the exception's own `__str__` fails: it must still be reported."""
    try:
        return str(exc)
    except Exception:
        return ""


def _relative_import_hint(exc: BaseException, model_dir: Path) -> str:
    """A hint when the module imported a sibling by its plain name, which only a relative import finds."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing:
        return ""
    top = missing.partition(".")[0]
    if (model_dir / f"{top}.py").is_file() or (model_dir / top).is_dir():
        return (f"; {top!r} is a module of the model directory, which is not on sys.path: import it "
                f"relatively (from . import {top})")
    return ""
