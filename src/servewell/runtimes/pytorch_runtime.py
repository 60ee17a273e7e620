"""Eager PyTorch modules: a `module:callable` factory plus a weights file, loaded in layers.

Layered loading keeps peak memory near one copy of the weights: the module is built on the
meta device (no storage), the weights are memory-mapped, each floating tensor is converted to
the serving dtype on the CPU and then copied to its device (one tensor at a time, so the host
never holds a second full copy), and assigned into the module as it is (`assign=True`, no copy).
Submodules named in `pytorch.lazy_submodules` stay on meta until their first forward call (see
`lazy_weights`).
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
from torch.overrides import TorchFunctionMode

from servewell.config.model import ModelConfig, PyTorchSettings
from servewell.runtimes.base import ModelLoadError, ProgressFn
from servewell.runtimes.lazy_weights import LazySubmoduleWeights, is_lazy, split_lazy
from servewell.runtimes.torch_execution import TorchModuleRuntime, dtype_name, prepare_torch

StateDict = dict[str, torch.Tensor]

_PICKLE_REFUSED = (
    "{artifact} is not a plain state dict: it holds pickled Python objects (likely a whole "
    "nn.Module saved with torch.save(model)). Loading a pickled model runs arbitrary code from "
    "the file, so it is refused. Save weights with safetensors or torch.save(model.state_dict()), "
    "or set `pytorch: {{unsafe_allow_pickle: true}}` in model.yaml for a file you trust."
)


def load(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> TorchModuleRuntime:
    """Build the factory's module and load `model_dir / config.artifact` into it.

    The model directory goes first on `sys.path`, so a factory module shipped beside the weights
    imports (a worker process serves one model, so its module names cannot clash with another's).
    With `pytorch.dtype: auto` resolved to a reduced dtype, the runtime can rebuild the model in
    fp32 from the same files, for warm-up's precision check.
    """
    settings = pytorch_settings(config)
    device, dtype = prepare_torch(config)
    model_path = str(model_dir.resolve())
    if model_path not in sys.path:
        sys.path.insert(0, model_path)
        importlib.invalidate_caches()
    module = build_module(config, model_dir, device, dtype, progress)
    reference = None
    if settings.dtype == "auto" and dtype != torch.float32:
        reference = functools.partial(build_module, config, model_dir, device, torch.float32, _quiet)
    return TorchModuleRuntime(module, config, device, dtype, fp32_reference=reference)


def pytorch_settings(config: ModelConfig) -> PyTorchSettings:
    """The `pytorch:` section; a config that passed validation always has one for runtime pytorch."""
    if config.pytorch is None:
        raise ModelLoadError("runtime pytorch needs a 'pytorch' section with 'factory: module:callable'")
    return config.pytorch


def build_module(
    config: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype, progress: ProgressFn
) -> torch.nn.Module:
    """The model of `config` in `dtype` on `device`, in eval mode and without gradients."""
    settings = pytorch_settings(config)
    loaded = _read_weights(model_dir / config.artifact, config.artifact, settings.unsafe_allow_pickle, progress)
    if isinstance(loaded, torch.nn.Module):
        if settings.lazy_submodules:
            raise ModelLoadError(
                "lazy_submodules needs a weights file (safetensors or a state dict); "
                f"{config.artifact} holds a whole pickled module, which loads all at once"
            )
        progress(f"use the pickled module; factory {settings.factory} is not called")
        module = loaded
        progress(f"convert to {dtype_name(dtype)}")
        module.to(dtype)
        progress(f"move to {device}")
        module.to(device)
    else:
        factory = import_factory(settings.factory, model_dir)
        progress("build graph on meta device")
        module = build_on_meta(factory, settings.factory_kwargs)
        eager, lazy = split_lazy(module, settings.lazy_submodules, loaded, config.artifact)
        del loaded
        steps = []
        converting = any(t.is_floating_point() and t.dtype != dtype for t in eager.values())
        if converting:
            steps.append(f"convert to {dtype_name(dtype)}")
        if device.type != "cpu":
            steps.append(f"move to {device}")
        if steps:
            progress(", ".join(steps))
        # Once the weights are converted, the mapped file is only needed by the few tensors
        # that need no conversion (integer buffers); copying those lets the mapping go.
        prepare = functools.partial(_prepare_tensor, dtype=dtype, device=device, copy_unconverted=converting)
        # One tensor at a time: each converted CPU copy is freed once it is on the device.
        prepared = {key: prepare(eager.pop(key)) for key in list(eager)}
        progress("assign weights")
        _assign(module, prepared, config.artifact, settings.lazy_submodules)
        for name, tensors in lazy.items():
            LazySubmoduleWeights(module.get_submodule(name), tensors, prepare)
    module.eval()
    module.requires_grad_(False)
    return module


def _prepare_tensor(
    tensor: torch.Tensor, *, dtype: torch.dtype, device: torch.device, copy_unconverted: bool
) -> torch.Tensor:
    """Convert a floating tensor to `dtype` on the CPU, then copy it to `device`: to fp16/bf16, only
    half the bytes cross to the device and the device never holds the fp32 copy.

    A tensor that needs neither is returned as it is (still backed by the mapped file) unless
    `copy_unconverted`.
    """
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype).to(device)
    if copy_unconverted and device.type == "cpu":
        return tensor.clone()
    return tensor.to(device)


def _quiet(stage: str) -> None:
    """Progress sink of the fp32 rebuild: warm-up reports that step itself."""


def build_on_meta(factory: Callable[..., object], kwargs: Mapping[str, object]) -> torch.nn.Module:
    """Call `factory(**kwargs)` with meta as the default device, so no weight storage is allocated.

    Initialisers (`torch.nn.init.*`, random fills) are skipped on meta tensors: there are no
    values to fill, and torch runs some of them (`normal_`) through Python references whose first
    use imports torch._dynamo and sympy, about 2 s and 70 MB for every worker.
    """
    try:
        with torch.device("meta"), _SkipInitOnMeta():
            module = factory(**kwargs)
    except Exception as exc:
        # str(), not repr(): an OSError's repr leaves out the file it could not open.
        raise ModelLoadError(f"the factory failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, torch.nn.Module):
        raise ModelLoadError(f"the factory returned {type(module).__name__}, not a torch.nn.Module")
    return module


class _SkipInitOnMeta(TorchFunctionMode):
    """Turns value initialisers on meta tensors into no-ops; every other call runs as usual."""

    _INITIALISERS = frozenset(
        [getattr(torch.nn.init, name) for name in (
            "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
            "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
        )]
        + [getattr(torch.Tensor, name) for name in (
            "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "bernoulli_",
        )]
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func in self._INITIALISERS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _read_weights(path: Path, artifact: str, allow_pickle: bool, progress: ProgressFn) -> StateDict | torch.nn.Module:
    """Memory-map a weights file; a pickled module only with `pytorch.unsafe_allow_pickle`."""
    progress("map weights")
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt", device="cpu") as weights:
                return {key: weights.get_tensor(key) for key in weights.keys()}
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise ModelLoadError(f"cannot read safetensors file {artifact}: {exc}") from exc
    try:
        loaded = _torch_load(path, artifact, weights_only=True)
    except pickle.UnpicklingError as exc:
        if not allow_pickle:
            raise ModelLoadError(_PICKLE_REFUSED.format(artifact=artifact)) from exc
        progress("unpickle (unsafe_allow_pickle)")
        loaded = _torch_load(path, artifact, weights_only=False)
        if isinstance(loaded, torch.nn.Module):
            return loaded
    return _as_state_dict(loaded, artifact)


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


def import_factory(spec: str, model_dir: Path) -> Callable[..., object]:
    """The callable `spec` ('module:callable') names, imported with `model_dir` first on `sys.path`
    (the caller puts it there); `ModelLoadError` when it cannot be imported or called."""
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


def _assign(module: torch.nn.Module, state: StateDict, artifact: str, lazy_names: list[str]) -> None:
    # strict=False so that missing and unexpected keys are reported below, a few at a time and
    # in words, instead of torch's list of every key; the check itself is as strict.
    try:
        result = module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches are raised regardless of strict
        raise ModelLoadError(f"weights in {artifact} do not fit the module the factory built: {exc}") from exc
    problems = []
    missing = [key for key in result.missing_keys if not is_lazy(key, lazy_names)]
    if missing:
        problems.append(f"missing from the file: {_few(missing)}")
    if result.unexpected_keys:
        problems.append(f"not in the module: {_few(result.unexpected_keys)}")
    if problems:
        raise ModelLoadError(f"weights in {artifact} do not match the module; " + "; ".join(problems))
    on_meta = [
        name
        for name, t in chain(module.named_parameters(), module.named_buffers())
        if t.is_meta and not is_lazy(name, lazy_names)
    ]
    if on_meta:
        raise ModelLoadError(
            f"no values for {_few(on_meta)} after loading {artifact}: the factory runs on the meta "
            "device, so a tensor that is not in the weights file (a non-persistent buffer) stays "
            "empty; register it with persistent=True and save it with the weights"
        )


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
