"""A second digits classifier that is not a neural network: scikit-learn's logistic regression,
trained when the example is built and kept as plain arrays (`weights.npz`: coef [10, 64],
intercept [10]), so serving it needs numpy only and loads no pickle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class LinearDigits:
    """`execute`: {"input": [n, 1, 8, 8]} -> {"scores": [n, 10]} (class probabilities)."""

    def setup(self, config: dict[str, Any]) -> None:
        with np.load(Path(config["directory"]) / "weights.npz") as weights:
            self.coef = weights["coef"].astype(np.float32)
            self.intercept = weights["intercept"].astype(np.float32)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["input"].reshape(len(inputs["input"]), -1)
        z = x @ self.coef.T + self.intercept
        z -= z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return {"scores": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)}
