"""`load_runtime`: file checks before any backend is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell.config.model import ModelConfig
from servewell.runtimes import ModelLoadError, load_runtime


def make_config(runtime: str = "onnx", artifact: str = "model.onnx") -> ModelConfig:
    return ModelConfig(
        name="m",
        runtime=runtime,
        artifact=artifact,
        factory="net:build" if runtime == "pytorch" else None,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [3]}],
    )


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model directory .* does not exist"):
        load_runtime(make_config(), tmp_path / "absent", lambda stage: None)


@pytest.mark.parametrize("runtime", ["onnx", "torchscript", "pytorch"])
def test_missing_artifact_names_the_file(tmp_path: Path, runtime: str) -> None:
    with pytest.raises(ModelLoadError, match="artifact 'weights.bin' named in model.yaml is not a file"):
        load_runtime(make_config(runtime, "weights.bin"), tmp_path, lambda stage: None)


def test_artifact_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").mkdir()
    with pytest.raises(ModelLoadError, match="is not a file"):
        load_runtime(make_config(), tmp_path, lambda stage: None)


@pytest.mark.parametrize("runtime", ["onnx", "torchscript"])
def test_lazy_submodules_need_the_pytorch_runtime(tmp_path: Path, runtime: str) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    config = make_config(runtime).model_copy(update={"lazy_submodules": ["head"]})
    with pytest.raises(ModelLoadError, match="lazy_submodules works with runtime pytorch only"):
        load_runtime(config, tmp_path, lambda stage: None)
