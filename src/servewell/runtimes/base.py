"""The interface every model backend implements. Runs inside a worker process only."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from servewell.config.model import ModelConfig

#: Called by a runtime while it loads, with a short stage name ("read graph", "load weights", ...).
ProgressFn = Callable[[str], None]


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says why in words a user can act on."""


class ModelRuntime(Protocol):
    """A loaded model that runs batches of numpy arrays."""

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. Inputs and outputs are keyed by the tensor names of the model config;
        outputs are numpy arrays in the dtypes the config declares."""
        ...

    def close(self) -> None:
        """Release the model's resources."""
        ...


RuntimeLoader = Callable[[ModelConfig, Path, ProgressFn], ModelRuntime]
