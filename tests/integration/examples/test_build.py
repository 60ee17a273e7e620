"""Building the example models: the digits model is trained once per session and checked end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import yaml
from PIL import Image

from servewell.config.model import ModelConfig
from servewell.examples.build import build_model
from servewell.examples.digits import load_split, render_digit
from servewell.examples.example_images import (
    EXAMPLE_IMAGES_DIR,
    EXAMPLES,
    ExampleImage,
    label_from_filename,
    write_example_images,
)
from servewell.examples.resnet import ARTIFACTS, resnet50, resnet50_config_dict
from servewell.imaging import transform_image


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("repo")


@pytest.fixture(scope="session")
def built_digits(repository: Path) -> tuple[Path, list[str]]:
    """The digits model built once, with the progress lines the build reported."""
    lines: list[str] = []
    return build_model("digits", repository, progress=lines.append), lines


@pytest.fixture(scope="session")
def digits_config(built_digits: tuple[Path, list[str]]) -> ModelConfig:
    model_dir, _ = built_digits
    return ModelConfig.model_validate(yaml.safe_load((model_dir / "model.yaml").read_text()))


@pytest.fixture(scope="session")
def digits_session(built_digits: tuple[Path, list[str]], digits_config: ModelConfig) -> onnxruntime.InferenceSession:
    model_dir, _ = built_digits
    return onnxruntime.InferenceSession(str(model_dir / digits_config.artifact), providers=["CPUExecutionProvider"])


def classify(session: onnxruntime.InferenceSession, config: ModelConfig, images: list[Image.Image]) -> np.ndarray:
    assert config.preprocess is not None
    batch = np.stack([transform_image(image, config.preprocess) for image in images])
    (logits,) = session.run(["logits"], {"input": batch})
    assert logits.shape == (len(images), 10)
    return logits.argmax(axis=1)


def test_build_reports_progress_and_writes_a_valid_config(
    built_digits: tuple[Path, list[str]], digits_config: ModelConfig
) -> None:
    model_dir, lines = built_digits
    assert model_dir.name == "digits" and (model_dir / "model.onnx").is_file()
    assert any(line.startswith("digits: training epoch 1/") for line in lines)
    assert any(line.startswith("digits: exported model.onnx (acc ") for line in lines)
    assert digits_config.name == "digits" and digits_config.runtime == "onnx"
    assert [(t.name, t.datatype, t.shape) for t in digits_config.inputs] == [("input", "FP32", [1, 8, 8])]
    assert [(t.name, t.datatype, t.shape) for t in digits_config.outputs] == [("logits", "FP32", [10])]
    assert digits_config.preprocess is not None and digits_config.preprocess.fit == "ink_bbox"
    assert digits_config.postprocess is not None and digits_config.postprocess.labels == [str(d) for d in range(10)]
    assert float(digits_config.metadata["test_accuracy"]) >= 0.97
    # The repository holds nothing but the model (and its lock): no work directories left behind.
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [".digits.lock", "digits"]


def test_test_split_accuracy_through_the_served_preprocessing(
    digits_session: onnxruntime.InferenceSession, digits_config: ModelConfig
) -> None:
    _, x_test, _, y_test = load_split()
    predicted = classify(digits_session, digits_config, [render_digit(x) for x in x_test])
    assert (predicted == y_test).mean() >= 0.95


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.filename)
def test_every_shipped_example_image_is_classified_as_its_label(
    example: ExampleImage, digits_session: onnxruntime.InferenceSession, digits_config: ModelConfig
) -> None:
    path = EXAMPLE_IMAGES_DIR / example.filename
    assert path.stat().st_size < 20_000
    (predicted,) = classify(digits_session, digits_config, [Image.open(path)])
    assert str(predicted) == label_from_filename(path.name)


def test_shipped_example_images_match_their_generator(tmp_path: Path) -> None:
    shipped = sorted(p.name for p in EXAMPLE_IMAGES_DIR.iterdir())
    written = write_example_images(tmp_path)
    assert sorted(p.name for p in written) == shipped
    for path in written:
        fresh = np.asarray(Image.open(path), dtype=np.float32)
        kept = np.asarray(Image.open(EXAMPLE_IMAGES_DIR / path.name), dtype=np.float32)
        assert fresh.shape == kept.shape
        # PNG is lossless; JPEG decoders may differ by a level here and there.
        assert np.abs(fresh - kept).mean() < (0.01 if path.suffix == ".png" else 1.0)


def test_building_again_is_a_no_op(built_digits: tuple[Path, list[str]], repository: Path) -> None:
    model_dir, _ = built_digits
    before = (model_dir / "model.onnx").stat().st_mtime_ns
    lines: list[str] = []
    assert build_model("digits", repository, progress=lines.append) == model_dir
    assert lines == [f"digits: up to date in {model_dir}"]
    assert (model_dir / "model.onnx").stat().st_mtime_ns == before


def test_cli_exits_zero_when_the_model_is_current(built_digits: tuple[Path, list[str]], repository: Path) -> None:
    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "servewell.examples.build", "digits", "--out", str(repository)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "digits: up to date" in done.stderr


def test_unknown_model_or_runtime_is_refused_without_leaving_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown example model"):
        build_model("nope", tmp_path, progress=lambda _: None)
    with pytest.raises(ValueError, match="builds for onnx"):
        build_model("digits", tmp_path, runtime="torchscript", progress=lambda _: None)
    assert not (tmp_path / "digits").exists()


def test_resnet50_matches_the_torchvision_layout() -> None:
    import torch

    with torch.device("meta"):
        model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    state = model.state_dict()
    assert len(state) == 320
    for key in ("conv1.weight", "layer1.0.downsample.0.weight", "layer4.2.bn3.running_var", "fc.bias"):
        assert key in state
    with torch.device("meta"):
        head = resnet50(num_classes=10).fc
        assert isinstance(head, torch.nn.Linear) and head.out_features == 10


@pytest.mark.parametrize("runtime", sorted(ARTIFACTS))
def test_resnet50_config_is_valid_for_every_runtime(runtime: str) -> None:
    config = ModelConfig.model_validate(resnet50_config_dict(runtime))
    assert config.runtime == runtime and config.max_batch_size == 32
    assert "NOT trained" in config.metadata["weights"]
    assert (config.pytorch is not None) == (runtime == "pytorch")
    if config.pytorch is not None:
        assert config.pytorch.factory == "servewell.examples.resnet:resnet50"
