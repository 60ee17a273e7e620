"""TorchScript archives (`torch.jit.save`) run by the TorchScript interpreter."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from servewell.config.model import ModelConfig, TorchScriptSettings
from servewell.runtimes.base import ModelLoadError, ProgressFn
from servewell.runtimes.torch_execution import TorchModuleRuntime, dtype_name, prepare_torch


def load(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> TorchModuleRuntime:
    """Load `model_dir / config.artifact` in the serving dtype, then freeze and optimize it if asked.

    With `torchscript.dtype: auto` resolved to a reduced dtype, the runtime can load the archive
    again in fp32, for warm-up's precision check.
    """
    settings = config.torchscript or TorchScriptSettings()
    device, dtype = prepare_torch(config)
    module = load_scripted(config, model_dir, device, dtype, progress)
    reference = None
    if settings.dtype == "auto" and dtype != torch.float32:
        reference = functools.partial(load_scripted, config, model_dir, device, torch.float32, lambda stage: None)
    return TorchModuleRuntime(module, config, device, dtype, fp32_reference=reference)


def load_scripted(
    config: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype, progress: ProgressFn
) -> torch.jit.ScriptModule:
    """The archive's module in `dtype` on `device`, frozen and optimized as model.yaml's `torchscript:` asks."""
    settings = config.torchscript or TorchScriptSettings()
    progress("read TorchScript archive")
    try:
        # Load to the CPU so a dtype conversion happens before the device copy, not after.
        module = torch.jit.load(str(model_dir / config.artifact), map_location="cpu")
    except Exception as exc:  # torch raises RuntimeError or its own C++ error types
        raise ModelLoadError(
            f"{config.artifact} is not a TorchScript archive ({exc}); "
            "a state dict or safetensors file needs runtime: pytorch"
        ) from exc
    module.eval()
    progress(f"convert to {dtype_name(dtype)}")
    module.to(dtype)
    if device.type != "cpu":
        progress(f"move to {device}")
        module.to(device)
    try:
        if settings.freeze or settings.optimize_for_inference:
            progress("freeze")
            module = torch.jit.freeze(module)
        if settings.optimize_for_inference:
            progress("optimize for inference")
            module = torch.jit.optimize_for_inference(module)
    except Exception as exc:
        raise ModelLoadError(f"TorchScript freeze/optimize failed on {config.artifact}: {exc}") from exc
    return module
