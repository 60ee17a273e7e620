"""A toy runtime, added the way a newcomer adds one: a backend module (this one: numpy only, y = x *
factor), a settings section, and one descriptor handed to `register_runtime`. Nothing else of
servewell changes for it (tests/unit/config/test_runtime_registry.py, tests/integration/workers/
test_toy_runtime.py).

Its weights estimate is ten times its artifact's size, so a test can tell that the memory
estimate asked this runtime rather than reading the file's size as the default does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from servewell.config.runtimes import RuntimeDescriptor
from servewell.config.strict import StrictModel

MiB = 1 << 20
#: What the estimate counts per byte of the artifact (the default counts 1).
WEIGHT_BYTES_PER_FILE_BYTE = 10


class ToySettings(StrictModel):
    """Settings of the toy runtime."""

    factor: float = Field(2.0, description="What the toy model multiplies its input by.")


class ToyModel:
    """y = x * factor, for every input named in the config (one input x, one output y)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch: y = x * factor, in float32 as the config declares."""
        return {"y": (inputs["x"] * self.factor).astype(np.float32)}

    def close(self) -> None:
        """Nothing to release."""


def load(config: Any, model_dir: Path, progress: Callable[[str], None]) -> ToyModel:
    """The toy runtime's loader (a worker calls it, config/runtimes.py `backend`)."""
    progress("toy")
    settings = config.runtime_settings
    assert isinstance(settings, ToySettings)
    return ToyModel(settings.factor)


def weight_bytes(config: Any, model_dir: Path) -> tuple[int, str]:
    """The toy runtime's estimate of its weights: ten times its artifact's size."""
    size = (model_dir / config.artifact).stat().st_size
    return size * WEIGHT_BYTES_PER_FILE_BYTE, f"toy estimate, {WEIGHT_BYTES_PER_FILE_BYTE}x {config.artifact}"


TOY = RuntimeDescriptor(
    "toy", "the model multiplies its input by a factor (a test's runtime)",
    backend="toy_runtime", section=ToySettings, base_bytes=7 * MiB, weight_bytes="toy_runtime:weight_bytes",
    triton_platform="toy_platform", triton_backend="toy_backend",
)


def toy_model_yaml(factor: float | None = None, **changes: Any) -> dict[str, Any]:
    """A model.yaml of the toy runtime (`factor`: its section's; None leaves the section out)."""
    document: dict[str, Any] = {
        "name": "toy", "runtime": "toy", "artifact": "toy.txt", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
    }
    if factor is not None:
        document["toy"] = {"factor": factor}
    return {**document, **changes}
