"""Eager PyTorch modules: a `module:callable` factory plus a weights file, loaded in layers.

Layered loading keeps peak memory near one copy of the weights: the module is built on the
meta device (no storage), the weights are memory-mapped, floating tensors are converted to the
serving dtype on the CPU, assigned into the module as they are (`assign=True`, no copy), and the
module moves to its device once.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
from collections.abc import Callable, Mapping
from itertools import chain
from pathlib import Path

import torch
from safetensors import safe_open

from servewell.config.model import ModelConfig
from servewell.runtimes.base import ModelLoadError, ProgressFn
from servewell.runtimes.torch_execution import (
    TorchModuleRuntime,
    dtype_name,
    resolve_device,
    resolve_serving_dtype,
)

StateDict = dict[str, torch.Tensor]

_PICKLE_REFUSED = (
    "{artifact} is not a plain state dict: it holds pickled Python objects (likely a whole "
    "nn.Module saved with torch.save(model)). Loading a pickled model runs arbitrary code from "
    "the file, so it is refused. Save weights with safetensors or torch.save(model.state_dict()), "
    "or set `unsafe_allow_pickle: true` in model.yaml for a file you trust."
)


def load(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> TorchModuleRuntime:
    """Build the factory's module and load `model_dir / config.artifact` into it.

    The model directory goes first on `sys.path`, so a factory module shipped beside the weights
    imports (a worker process serves one model, so its module names cannot clash with another's).
    """
    device = resolve_device(config.device)
    dtype = resolve_serving_dtype(config.dtype, device)
    torch.set_num_threads(config.threads)
    model_path = str(model_dir.resolve())
    if model_path not in sys.path:
        sys.path.insert(0, model_path)
        importlib.invalidate_caches()

    loaded = _read_weights(model_dir / config.artifact, config, progress)
    if isinstance(loaded, torch.nn.Module):
        progress(f"use the pickled module; factory {config.factory} is not called")
        module = loaded
        progress(f"convert to {dtype_name(dtype)}")
        module.to(dtype)
    else:
        factory = _import_factory(str(config.factory), model_dir)
        progress("build graph on meta device")
        module = build_on_meta(factory, config.factory_kwargs)
        if any(t.is_floating_point() and t.dtype != dtype for t in loaded.values()):
            progress(f"convert to {dtype_name(dtype)}")
            loaded = {k: t.to(dtype) if t.is_floating_point() else t for k, t in loaded.items()}
        progress("assign weights")
        _assign(module, loaded, config.artifact)
    progress(f"move to {device}")
    module.to(device)
    module.eval()
    module.requires_grad_(False)
    return TorchModuleRuntime(module, config, device, dtype)


def build_on_meta(factory: Callable[..., object], kwargs: Mapping[str, object]) -> torch.nn.Module:
    """Call `factory(**kwargs)` with meta as the default device, so no weight storage is allocated."""
    try:
        with torch.device("meta"):
            module = factory(**kwargs)
    except Exception as exc:
        raise ModelLoadError(f"the factory failed: {exc!r}") from exc
    if not isinstance(module, torch.nn.Module):
        raise ModelLoadError(f"the factory returned {type(module).__name__}, not a torch.nn.Module")
    return module


def _read_weights(path: Path, config: ModelConfig, progress: ProgressFn) -> StateDict | torch.nn.Module:
    """Memory-map a weights file; a pickled module only with `unsafe_allow_pickle`."""
    progress("map weights")
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt", device="cpu") as weights:
                return {key: weights.get_tensor(key) for key in weights.keys()}
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise ModelLoadError(f"cannot read safetensors file {config.artifact}: {exc}") from exc
    try:
        loaded = _torch_load(path, config.artifact, weights_only=True)
    except pickle.UnpicklingError as exc:
        if not config.unsafe_allow_pickle:
            raise ModelLoadError(_PICKLE_REFUSED.format(artifact=config.artifact)) from exc
        progress("unpickle (unsafe_allow_pickle)")
        loaded = _torch_load(path, config.artifact, weights_only=False)
        if isinstance(loaded, torch.nn.Module):
            return loaded
    return _as_state_dict(loaded, config.artifact)


def _torch_load(path: Path, artifact: str, *, weights_only: bool) -> object:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except pickle.UnpicklingError:
        raise  # the caller decides whether pickled objects may be loaded
    except Exception as exc:
        raise ModelLoadError(f"cannot read weights file {artifact}: {exc}") from exc


def _as_state_dict(loaded: object, artifact: str) -> StateDict:
    if not isinstance(loaded, Mapping):
        raise ModelLoadError(f"{artifact} holds a {type(loaded).__name__}, not a state dict of named tensors")
    odd = [str(key) for key, value in loaded.items() if not isinstance(value, torch.Tensor)]
    if odd:
        raise ModelLoadError(
            f"{artifact} is not a plain state dict: {_few(odd)} are not tensors "
            "(a training checkpoint? save model.state_dict() instead)"
        )
    return {str(key): value for key, value in loaded.items()}


def _import_factory(spec: str, model_dir: Path) -> Callable[..., object]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelLoadError(f"cannot import factory module {module_name!r}: {exc!r}") from exc
    _check_imported_from(module_name, model_dir)
    try:
        factory = functools.reduce(getattr, attr.split("."), module)
    except AttributeError as exc:
        raise ModelLoadError(f"factory {spec!r}: module {module_name!r} has no {attr!r}") from exc
    if not callable(factory):
        raise ModelLoadError(f"factory {spec!r} is not callable")
    return factory


def _check_imported_from(module_name: str, model_dir: Path) -> None:
    """Refuse a same-named module imported earlier from elsewhere: it would build the wrong model."""
    top = module_name.partition(".")[0]
    if not ((model_dir / f"{top}.py").is_file() or (model_dir / top).is_dir()):
        return
    origin = getattr(sys.modules[top], "__file__", None)
    if origin is not None and not Path(origin).resolve().is_relative_to(model_dir.resolve()):
        raise ModelLoadError(
            f"module {top!r} of the model directory clashes with {origin}, imported earlier; rename it"
        )


def _assign(module: torch.nn.Module, state: StateDict, artifact: str) -> None:
    # strict=False so that missing and unexpected keys are reported below, a few at a time and
    # in words, instead of torch's list of every key; the check itself is as strict.
    try:
        result = module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches are raised regardless of strict
        raise ModelLoadError(f"weights in {artifact} do not fit the module the factory built: {exc}") from exc
    problems = []
    if result.missing_keys:
        problems.append(f"missing from the file: {_few(result.missing_keys)}")
    if result.unexpected_keys:
        problems.append(f"not in the module: {_few(result.unexpected_keys)}")
    if problems:
        raise ModelLoadError(f"weights in {artifact} do not match the module; " + "; ".join(problems))
    on_meta = [name for name, t in chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
    if on_meta:
        raise ModelLoadError(
            f"no values for {_few(on_meta)} after loading {artifact}: the factory runs on the meta "
            "device, so a tensor that is not in the weights file (a non-persistent buffer) stays "
            "empty; register it with persistent=True and save it with the weights"
        )


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
