"""The example pipelines on the digits model, and the python-runtime models they use.

- `digits_page` (a sequence): `digits_crop` finds the digit on a larger page and cuts it out as
  the classifier's 8x8 input, `digits` (the ONNX CNN) classifies it, `digits_format` turns logits
  into probabilities, a label and a confidence. Its page input takes images through `/predict`.
- `digits_ensemble` (a fan-out and fan-in): `digits` and `digits_linear` (scikit-learn's logistic
  regression, served by the python runtime from plain arrays) classify the same input at once,
  and `digits_average` averages their probabilities.

Built with `python -m servewell.examples.build pipelines --out REPO` (which builds `digits` too);
each model's code is a file of `servewell/examples/steps/` copied into its directory, as a user's
would be. Nothing here imports torch but the linear model's training set (shared with the CNN's).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from servewell.config.model import ClassifyPostprocess, ImagePreprocess, ModelConfig
from servewell.examples.artifacts import ProgressFn, write_model_yaml
from servewell.examples.digits import DIGITS_PREPROCESS, LABELS

STEPS = Path(__file__).parent / "steps"
#: Rows of one pipeline request: within every step model's max_batch_size.
PIPELINE_MAX_BATCH = 16
#: What `/predict` makes of an image sent to `digits_page`: the page as grey values, not yet cropped.
PAGE_PREPROCESS = ImagePreprocess(size=(96, 96), channels=1, fit="stretch", scale=1.0, layout="CHW")
#: The pipelines' answer for `/predict`: labelled scores.
SCORES_POSTPROCESS = ClassifyPostprocess(output="scores", labels=LABELS, top_k=3)

_DIGIT = {"datatype": "FP32", "shape": [1, 8, 8]}
_SCORES = {"datatype": "FP32", "shape": [10]}


def _python_model(model_dir: Path, module: str, entry: str, inputs: list[dict[str, Any]],
                  outputs: list[dict[str, Any]], description: str, **fields: Any) -> ModelConfig:
    """A python-runtime model named after its module (`steps/<module>.py`, copied into `model_dir`)."""
    shutil.copyfile(STEPS / f"{module}.py", model_dir / f"{module}.py")
    settings = fields.pop("settings", {})
    return write_model_yaml(model_dir, {
        "name": module, "runtime": "python", "artifact": f"{module}.py",
        "python": {"entry": f"{module}:{entry}", "settings": settings},
        "inputs": inputs, "outputs": outputs, "max_batch_size": 64, "metadata": {"description": description},
        **fields,
    })


def build_crop(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`digits_crop`: page [1, H, W] -> digit [1, 8, 8] and the ink's box."""
    return _python_model(
        model_dir, "digits_crop", "Cropper", [{"name": "page", "datatype": "FP32", "shape": [1, -1, -1]}],
        [{"name": "digit", **_DIGIT}, {"name": "box", "datatype": "INT64", "shape": [4]}],
        "Finds the digit on a page (grey, dark ink on light paper) and crops it to the digits model's input.",
        settings={"preprocess": DIGITS_PREPROCESS.model_dump(mode="json", exclude_none=True)})


def build_format(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`digits_format`: logits -> probabilities, label, confidence."""
    return _python_model(
        model_dir, "digits_format", "Formatter", [{"name": "logits", **_SCORES}],
        [{"name": "scores", **_SCORES}, {"name": "label", "datatype": "INT64", "shape": [1]},
         {"name": "confidence", "datatype": "FP32", "shape": [1]}],
        "Turns digit logits into probabilities, the label and its confidence.")


def build_average(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`digits_average`: the ensemble's fan-in."""
    return _python_model(
        model_dir, "digits_average", "Average",
        [{"name": "cnn_logits", **_SCORES}, {"name": "linear_scores", **_SCORES}],
        [{"name": "scores", **_SCORES}], "Averages the CNN's and the linear model's digit probabilities.",
        name="digits_average")


def build_linear(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`digits_linear`: logistic regression on the CNN's training items, kept as arrays."""
    from sklearn.linear_model import LogisticRegression

    from servewell.examples.digits import load_split, render_digit
    from servewell.examples.digits_training import SEED, preprocess, training_set

    x_train, x_test, y_train, y_test = load_split()
    items, labels = training_set(x_train, y_train, np.random.default_rng(SEED))
    progress(f"fitting logistic regression on {len(items)} items")
    fit = LogisticRegression(max_iter=2000, C=0.5, random_state=SEED).fit(items.reshape(len(items), -1), labels)
    np.savez(model_dir / "weights.npz", coef=fit.coef_.astype(np.float32), intercept=fit.intercept_.astype(np.float32))
    test = np.stack([preprocess(render_digit(grid)) for grid in x_test]).reshape(len(x_test), -1)
    accuracy = float((fit.predict(test) == y_test).mean())
    progress(f"weights.npz written (test accuracy {accuracy:.1%})")
    return _python_model(
        model_dir, "digits_linear", "LinearDigits", [{"name": "input", **_DIGIT}], [{"name": "scores", **_SCORES}],
        "Logistic regression on the digits (scikit-learn, served from plain arrays by the python runtime).",
        extra_files=["weights.npz"],
        preprocess=DIGITS_PREPROCESS.model_dump(mode="json", exclude_none=True),
        postprocess=ClassifyPostprocess(labels=LABELS, top_k=3).model_dump(mode="json", exclude_none=True))


def build_page_pipeline(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`digits_page`: crop -> classify -> format."""
    return write_model_yaml(model_dir, {
        "name": "digits_page", "kind": "pipeline", "max_batch_size": PIPELINE_MAX_BATCH,
        "inputs": [{"name": "page", "datatype": "FP32", "shape": [1, -1, -1]}],
        "outputs": [{"name": "scores", **_SCORES}, {"name": "label", "datatype": "INT64", "shape": [1]},
                    {"name": "confidence", "datatype": "FP32", "shape": [1]},
                    {"name": "box", "datatype": "INT64", "shape": [4]}],
        "pipeline": {
            "steps": [
                {"name": "crop", "model": "digits_crop", "inputs": {"page": "page"}},
                {"name": "classify", "model": "digits", "inputs": {"input": "crop.digit"}},
                {"name": "format", "model": "digits_format", "inputs": {"logits": "classify.logits"}},
            ],
            "outputs": {"scores": "format.scores", "label": "format.label", "confidence": "format.confidence",
                        "box": "crop.box"},
        },
        "preprocess": PAGE_PREPROCESS.model_dump(mode="json", exclude_none=True),
        "postprocess": SCORES_POSTPROCESS.model_dump(mode="json", exclude_none=True),
        "metadata": {"description": "A digit anywhere on a page: crop (python), classify (ONNX), format (python)."},
    })


def build_ensemble_pipeline(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`digits_ensemble`: the CNN and the linear model at once, averaged."""
    return write_model_yaml(model_dir, {
        "name": "digits_ensemble", "kind": "pipeline", "max_batch_size": PIPELINE_MAX_BATCH,
        "inputs": [{"name": "input", **_DIGIT}],
        "outputs": [{"name": "scores", **_SCORES}],
        "pipeline": {
            "steps": [
                {"name": "cnn", "model": "digits", "inputs": {"input": "input"}},
                {"name": "linear", "model": "digits_linear", "inputs": {"input": "input"}},
                {"name": "average", "model": "digits_average",
                 "inputs": {"cnn_logits": "cnn.logits", "linear_scores": "linear.scores"}},
            ],
            "outputs": {"scores": "average.scores"},
        },
        "preprocess": DIGITS_PREPROCESS.model_dump(mode="json", exclude_none=True),
        "postprocess": SCORES_POSTPROCESS.model_dump(mode="json", exclude_none=True),
        "metadata": {"description": "Two digit classifiers (CNN and logistic regression) run at once, averaged."},
    })
