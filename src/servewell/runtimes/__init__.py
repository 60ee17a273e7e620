"""Model backends: ONNX Runtime, TorchScript, PyTorch (+ safetensors), and python (the model's own class).

`load_runtime` is the one entry point. Each backend module is imported only when a model
needs it, so importing this package pulls in neither torch nor onnxruntime.
"""

from __future__ import annotations

from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.runtimes.base import DeviceUnusableError, ModelLoadError, ModelRuntime, ProgressFn, RuntimeLoader

__all__ = ["DeviceUnusableError", "ModelLoadError", "ModelRuntime", "ProgressFn", "load_runtime"]

#: Python package each runtime needs, named in the error when it is missing.
_RUNTIME_PACKAGE = {"onnx": "onnxruntime", "torchscript": "torch", "pytorch": "torch"}
#: The servewell extra that installs it.
_RUNTIME_EXTRA = {"onnx": "onnx", "torchscript": "torch", "pytorch": "torch"}


def load_runtime(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> ModelRuntime:
    """Load the model that `config` describes from `model_dir` with the backend it names.

    `progress` is called with a short stage name as loading goes. Raises `ModelLoadError`
    with a message a user can act on when the files or the model do not fit the config.
    """
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    artifact = model_dir / config.artifact
    if not artifact.is_file():
        raise ModelLoadError(
            f"artifact {config.artifact!r} named in model.yaml is not a file in {model_dir}"
        )
    return _loader(config.runtime)(config, model_dir, progress)


def _loader(runtime: str) -> RuntimeLoader:
    if runtime == "python":  # numpy only, which servewell itself needs: no package to name
        from servewell.runtimes import python_runtime

        return python_runtime.load
    try:
        if runtime == "onnx":
            from servewell.runtimes import onnx_runtime

            return onnx_runtime.load
        if runtime == "torchscript":
            from servewell.runtimes import torchscript_runtime

            return torchscript_runtime.load
        if runtime == "pytorch":
            from servewell.runtimes import pytorch_runtime

            return pytorch_runtime.load
    except ImportError as exc:
        raise ModelLoadError(
            f"runtime {runtime} needs the {_RUNTIME_PACKAGE[runtime]} package, which cannot be imported ({exc}); "
            f"install it with: pip install 'servewell[{_RUNTIME_EXTRA[runtime]}]'"
        ) from exc
    raise ModelLoadError(f"unknown runtime {runtime!r}; use onnx, torchscript, pytorch or python")
