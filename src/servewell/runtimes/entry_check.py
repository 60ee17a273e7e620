"""Check a python model's entry without running it: `servewell models` runs this in a child process.

    python -m servewell.runtimes.entry_check MODEL_DIR < config.json

Checks what model.yaml alone tells (the artifact is the entry module's file; no BYTES tensors),
then imports the entry module as the worker does (`python_entry`) and checks that it has the class
and that the class has `execute`: a module that does not import, a class renamed or misspelt,
fail a load at once. No instance is made and `setup` is not called: those may read data or take
a device, which is the load's business. Prints one JSON object,
`{"problems": [{"field": ..., "reason": ...}]}`, and exits 0 whether or not there are problems.

It runs in its own process because it imports the model's own code, which may hang, crash, print
or change the process; the CLI stays free of it.
"""

from __future__ import annotations

import contextlib
import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    """Read the config as JSON from stdin, check the entry in MODEL_DIR, print the problems as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m servewell.runtimes.entry_check MODEL_DIR < config.json", file=sys.stderr)
        return 2
    config = ModelConfig.model_validate_json(sys.stdin.read())
    with contextlib.redirect_stdout(sys.stderr):  # what the model's code prints must not garble the answer
        problems = check_entry(config, Path(args[0]))
    print(json.dumps({"problems": [{"field": p.field, "reason": p.reason} for p in problems]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
