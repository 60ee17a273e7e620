"""Model backends: ONNX Runtime, TorchScript, PyTorch (+ safetensors), and python (the model's own class).

`load_runtime` is the one entry point: it loads with the backend module its runtime's descriptor
names (config/runtimes.py). Each backend module is imported only when a model needs it, so
importing this package pulls in neither torch nor onnxruntime.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.runtimes import RuntimeDescriptor
from servewell.runtimes.base import DeviceUnusableError, ModelLoadError, ModelRuntime, ProgressFn, RuntimeLoader

__all__ = ["DeviceUnusableError", "ModelLoadError", "ModelRuntime", "ProgressFn", "load_runtime", "loader_of"]


def load_runtime(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> ModelRuntime:
    """Load the model that `config` describes from `model_dir` with the backend its runtime's
    descriptor names (config/runtimes.py).

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
    return loader_of(config.runtime_descriptor)(config, model_dir, progress)


def loader_of(runtime: RuntimeDescriptor) -> RuntimeLoader:
    """The `load` function of `runtime`'s backend module, imported now (with its framework);
    `ModelLoadError` naming the package and the extra that installs it when that cannot be imported."""
    if not runtime.in_worker:
        raise ModelLoadError(f"runtime {runtime.name} runs in the engine, not in a worker")
    try:
        backend = importlib.import_module(runtime.backend)
    except ImportError as exc:
        if not runtime.package:  # nothing beyond servewell's own needs: a bug or a broken install, as it is
            raise
        raise ModelLoadError(
            f"runtime {runtime.name} needs the {runtime.package} package, which cannot be imported ({exc}); "
            f"install it with: pip install 'servewell[{runtime.extra}]'"
        ) from exc
    load: RuntimeLoader = backend.load
    return load
