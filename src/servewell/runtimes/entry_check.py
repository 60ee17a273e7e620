"""Check a python model's entry without running it: `servewell models` runs this in a child process.

The python runtime's `check` in its descriptor (config/runtimes.py), which runtimes/check_child.py runs.

Checks what model.yaml alone tells (the artifact is the entry module's file; no BYTES tensors),
then imports the entry module as the worker does (`python_entry`) and checks that it has the class
and that the class has `execute`: a module that does not import, a class renamed or misspelt,
fail a load at once. No instance is made and `setup` is not called: those may read data or take
a device, which is the load's business. Returns the problems, each naming its field.

It runs in its own process because it imports the model's own code, which may hang, crash, print
or change the process; the CLI stays free of it.
"""

from __future__ import annotations

from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.problems import FieldProblem
from servewell.runtimes.base import ModelLoadError
from servewell.runtimes.python_entry import config_problems, forget_package, import_entry


def check_entry(config: ModelConfig, model_dir: Path) -> list[FieldProblem]:
    """Problems of `config`'s python entry, found by importing its class (not instantiating it)."""
    problems = config_problems(config)
    if problems or not (model_dir / config.artifact).is_file():
        return problems  # a missing artifact: `servewell models` reports it with the memory estimate
    try:
        _, package = import_entry(config, model_dir)
    except ModelLoadError as exc:
        return [FieldProblem("python.entry", str(exc))]
    forget_package(package)
    return []
