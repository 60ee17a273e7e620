"""Turn the classifier's logits into the answer a caller wants: probabilities, the label, its confidence."""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities from logits along the last axis (float64 inside, so large logits do not overflow)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class Formatter:
    """`execute`: {"logits": [n, 10]} -> {"scores": [n, 10], "label": [n, 1], "confidence": [n, 1]}."""

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = softmax(inputs["logits"])
        label = scores.argmax(axis=-1)
        return {"scores": scores.astype(np.float32), "label": label.astype(np.int64)[:, None],
                "confidence": scores.max(axis=-1).astype(np.float32)[:, None]}
