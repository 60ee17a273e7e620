"""TorchScript archives (`torch.jit.save`) run by the TorchScript interpreter."""

from __future__ import annotations

from pathlib import Path

import torch

from servewell.config.model import ModelConfig
from servewell.runtimes.base import ModelLoadError, ProgressFn
from servewell.runtimes.torch_execution import (
    TorchModuleRuntime,
    dtype_name,
    resolve_device,
    resolve_serving_dtype,
)


def load(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> TorchModuleRuntime:
    """Load `model_dir / config.artifact` in the serving dtype, then freeze and optimize it if asked."""
    device = resolve_device(config.device)
    dtype = resolve_serving_dtype(config.dtype, device)
    torch.set_num_threads(config.threads)
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
        if config.freeze or config.optimize_for_inference:
            progress("freeze")
            module = torch.jit.freeze(module)
        if config.optimize_for_inference:
            progress("optimize for inference")
            module = torch.jit.optimize_for_inference(module)
    except Exception as exc:
        raise ModelLoadError(f"TorchScript freeze/optimize failed on {config.artifact}: {exc}") from exc
    return TorchModuleRuntime(module, config, device, dtype)
