"""Check a pytorch model's factory without loading weights: `servewell models` runs this in a child process.

    python -m servewell.runtimes.factory_check MODEL_DIR < config.json

Imports the factory, builds the module on the meta device (no weight storage, so it takes a
fraction of a second even for a large model) and checks that every `pytorch.lazy_submodules`
name is a submodule: what model.yaml alone cannot tell. Prints one JSON object,
`{"problems": [{"field": ..., "reason": ...}]}`, and exits 0 whether or not there are problems.

It runs in its own process because it imports torch and the model's own code, which may hang,
crash or clash with another model's module of the same name; the CLI stays framework-free.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.problems import FieldProblem
from servewell.runtimes.base import ModelLoadError


def check_factory(config: ModelConfig, model_dir: Path) -> list[FieldProblem]:
    """Problems of `config`'s factory and lazy submodules, found by building the module on meta."""
    from servewell.runtimes.lazy_weights import unknown_submodules_problem
    from servewell.runtimes.pytorch_runtime import build_on_meta, import_factory, pytorch_settings

    settings = pytorch_settings(config)
    model_path = str(model_dir.resolve())
    if model_path not in sys.path:
        sys.path.insert(0, model_path)  # as the worker does: a factory module may ship beside the weights
        importlib.invalidate_caches()
    try:
        module = build_on_meta(import_factory(settings.factory, model_dir), settings.factory_kwargs)
    except ModelLoadError as exc:
        return [FieldProblem("pytorch.factory", str(exc))]
    problem = unknown_submodules_problem(module, settings.lazy_submodules)
    return [FieldProblem("pytorch.lazy_submodules", problem)] if problem is not None else []


def main(argv: list[str] | None = None) -> int:
    """Read the config as JSON from stdin, check the factory in MODEL_DIR, print the problems as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m servewell.runtimes.factory_check MODEL_DIR < config.json", file=sys.stderr)
        return 2
    config = ModelConfig.model_validate_json(sys.stdin.read())
    with contextlib.redirect_stdout(sys.stderr):  # what the model's code prints must not garble the answer
        problems = check_factory(config, Path(args[0]))
    print(json.dumps({"problems": [{"field": p.field, "reason": p.reason} for p in problems]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
