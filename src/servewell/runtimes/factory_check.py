"""Check a pytorch model's factory without loading weights: `servewell models` runs this in a child process.

The pytorch runtime's `check` in its descriptor (config/runtimes.py), which runtimes/check_child.py runs.

Imports the factory, builds the module on the meta device (no weight storage, so it takes a
fraction of a second even for a large model), checks that every `pytorch.lazy_submodules`
name is a submodule, and compares the module's parameter and buffer names and shapes with the
weights file's (a safetensors header, or a state dict memory-mapped, never read): what model.yaml
alone cannot tell, and what fails a load at once (`factory_kwargs` that build another shape, a
file of another model, a truncated or corrupt file). Returns the problems, each naming its field.

It runs in its own process because it imports torch and the model's own code, which may hang,
crash or clash with another model's module of the same name; the CLI stays framework-free.
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
from pathlib import Path

import torch

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
    problems = [FieldProblem("pytorch.lazy_submodules", problem)] if problem is not None else []
    return problems + weights_problems(config, model_dir, module)


def weights_problems(config: ModelConfig, model_dir: Path, module: torch.nn.Module) -> list[FieldProblem]:
    """Names and shapes of the module built on meta against the weights file's, as the load assigns them."""
    artifact = config.artifact
    if not (model_dir / artifact).is_file():
        return []  # `servewell models` reports a missing file with the memory estimate, which needs its size
    try:
        stored = stored_shapes(model_dir / artifact)
    except Exception as exc:  # safetensors and torch raise their own error types for a bad file
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]
        return [FieldProblem("artifact", f"cannot read the weights file {artifact}: {first}")]
    if stored is None:
        return []  # a pickled whole module (unsafe_allow_pickle): the factory is not used
    built = {name: list(tensor.shape) for name, tensor in module.state_dict().items()}
    problems = []
    kwargs = json.dumps(config.pytorch.factory_kwargs if config.pytorch else {}, sort_keys=True)
    differ = [f"{name} is {built[name]} in the module, {stored[name]} in {artifact}"
              for name in built if name in stored and built[name] != stored[name]]
    if differ:
        problems.append(FieldProblem("pytorch.factory_kwargs", f"the module built with factory_kwargs {kwargs} "
                                     f"does not fit the weights: {_few(differ, 3)}"))
    missing = [name for name in built if name not in stored]
    if missing:
        problems.append(FieldProblem("artifact", f"{artifact} lacks {len(missing)} tensor(s) of the module the "
                                     f"factory builds: {_few(missing)}"))
    unexpected = [name for name in stored if name not in built]
    if unexpected:
        problems.append(FieldProblem("artifact", f"{artifact} holds {len(unexpected)} tensor(s) the module the "
                                     f"factory builds does not have: {_few(unexpected)}"))
    return problems


def stored_shapes(path: Path) -> dict[str, list[int]] | None:
    """Each tensor's shape in a weights file, without reading the values; None for a pickled module."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as weights:
            return {key: list(weights.get_slice(key).get_shape()) for key in weights.keys()}
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError:
        return None  # not a plain state dict: the load says whether unpickling is allowed
    if not isinstance(loaded, dict):
        return None
    return {str(key): list(value.shape) for key, value in loaded.items() if isinstance(value, torch.Tensor)}


def _few(names: list[str], limit: int = 5) -> str:
    shown = "; ".join(names[:limit]) if limit <= 3 else ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
