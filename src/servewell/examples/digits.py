"""The built-in default model `digits`: a small CNN for handwritten digits, built from data that ships.

The data is scikit-learn's copy of the UCI optical digits (8x8 images, values 0..16), so the
model builds offline. Users send photos and scans of dark ink on light paper, and the server
feeds them through `transform_image` with `DIGITS_PREPROCESS`; so the model is trained on
8x8 samples rendered as paper images (`render_digit`, plus seeded variations) and passed
through that same transform, not on the raw 8x8 values.

This module needs no torch; training lives in `servewell.examples.digits_training`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PIL import Image

from servewell.config.model import ClassifyPostprocess, ImagePreprocess, ModelConfig
from servewell.examples.artifacts import ProgressFn

#: Class labels by output index.
LABELS: list[str] = [str(d) for d in range(10)]

#: What the server does to an image before the digits model sees it (and what training does).
DIGITS_PREPROCESS = ImagePreprocess(
    size=(8, 8), channels=1, invert=True, fit="ink_bbox", scale=16.0 / 255.0, layout="CHW"
)

#: Share of the `render_digit` canvas that the 8x8 grid covers; the rest is blank paper.
RENDER_FILL = 0.75



def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed train/test split: (x_train, x_test, y_train, y_test).

    x are float32 arrays of shape (n, 8, 8) holding the raw values 0..16; y are int64 labels.
    The split is stratified, 25% test, random_state 0.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = data.images.astype(np.float32)
    y = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return x_train, x_test, y_train, y_test


def render_digit(x8x8: np.ndarray, size: int = 64) -> Image.Image:
    """Render one 8x8 sample (values 0..16) as dark ink on white paper: a `size` x `size` grey image.

    The grid is enlarged smoothly (bicubic) to cover the middle `RENDER_FILL` of the canvas.
    """
    grid = np.asarray(x8x8, dtype=np.float32).reshape(8, 8)
    ink = Image.fromarray(np.clip(grid * (255.0 / 16.0) + 0.5, 0, 255).astype(np.uint8), "L")
    inner = max(8, round(size * RENDER_FILL))
    ink = ink.resize((inner, inner), Image.Resampling.BICUBIC)
    canvas = Image.new("L", (size, size), 0)
    offset = (size - inner) // 2
    canvas.paste(ink, (offset, offset))
    return Image.eval(canvas, lambda v: 255 - v)


def build_digits(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """Train the digits CNN and write `model.onnx` and `model.yaml` into `model_dir` (which must exist).

    Deterministic: the same package versions on the same kind of CPU give the same weights.
    Reports progress lines such as "training epoch 3/12"; returns the validated config.
    """
    from servewell.examples.artifacts import export_onnx, write_model_yaml
    from servewell.examples.digits_training import evaluate_onnx, train_digits

    started = time.perf_counter()
    x_train, x_test, y_train, y_test = load_split()
    model = train_digits(x_train, y_train, progress)
    export_onnx(model, (1, 8, 8), model_dir / "model.onnx")
    accuracy = evaluate_onnx(model_dir / "model.onnx", x_test, y_test)
    progress(f"exported model.onnx (acc {accuracy:.1%}, {time.perf_counter() - started:.1f} s)")
    return write_model_yaml(model_dir, digits_config_dict(accuracy))


def digits_config_dict(test_accuracy: float) -> dict[str, object]:
    """The `model.yaml` contents of the digits model, as plain data."""
    return {
        "name": "digits",
        "runtime": "onnx",
        "artifact": "model.onnx",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 8, 8]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [10]}],
        "max_batch_size": 64,
        "threads": 1,
        "preprocess": DIGITS_PREPROCESS.model_dump(mode="json", exclude_none=True),
        "postprocess": ClassifyPostprocess(labels=LABELS, top_k=3).model_dump(mode="json", exclude_none=True),
        "metadata": {
            "description": "Handwritten digit classifier (small CNN on 8x8 images). Send a photo or "
            "scan of one dark digit on light paper.",
            "dataset": "scikit-learn load_digits (UCI optical digits), bundled",
            "test_accuracy": f"{test_accuracy:.4f}",
            "trained": "deterministic, seed 0",
        },
    }
