"""The fan-in of the ensemble: the CNN's probabilities (from its logits) averaged with the linear model's."""

from __future__ import annotations

import numpy as np


class Average:
    """`execute`: {"cnn_logits": [n, 10], "linear_scores": [n, 10]} -> {"scores": [n, 10]}."""

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        z = inputs["cnn_logits"].astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        cnn = np.exp(z)
        cnn /= cnn.sum(axis=-1, keepdims=True)
        return {"scores": ((cnn + inputs["linear_scores"]) / 2.0).astype(np.float32)}
