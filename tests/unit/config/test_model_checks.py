"""Everything model.yaml alone can tell is checked when it loads, each problem named by its field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servewell.config.model import ModelConfig
from servewell.config.problems import field_problems

IMAGE_INPUT = {"name": "image", "datatype": "FP32", "shape": [3, 8, 8]}


def fields(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "m", "runtime": "onnx", "artifact": "model.onnx",
        "inputs": [IMAGE_INPUT],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [4]}],
    }
    return {**base, **changes}


def problems(**changes: Any) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(fields(**changes))
    return {p.field: p.reason for p in field_problems(caught.value)}


def test_mean_needs_one_value_per_channel_or_one_for_all() -> None:
    found = problems(preprocess={"size": [8, 8], "channels": 3, "mean": [0.5, 0.5]})
    assert found == {"preprocess.mean": "has 2 values; channels is 3, so give 3 (one per channel) or 1 "
                                        "(the same for every channel)"}
    ModelConfig.model_validate(fields(preprocess={"size": [8, 8], "mean": [0.5], "std": [0.2, 0.2, 0.2]}))


def test_std_of_the_wrong_length_is_refused() -> None:
    assert "has 4 values" in problems(preprocess={"size": [8, 8], "std": [1, 1, 1, 1]})["preprocess.std"]


def test_std_of_zero_is_refused() -> None:
    assert problems(preprocess={"size": [8, 8], "std": [1, 0, 1]}) == {"preprocess.std": "0 would divide by zero"}


def test_preprocess_size_must_be_positive() -> None:
    assert set(problems(preprocess={"size": [0, 8]})) == {"preprocess.size.0"}


def test_preprocessed_image_must_fit_the_input_shape() -> None:
    found = problems(preprocess={"size": [8, 8], "layout": "HWC"})
    assert found == {"preprocess": "produces images of shape [8, 8, 3] (layout HWC: channels 3, size [8, 8]), "
                                   "but input 'image' declares [3, 8, 8]"}


def test_variable_input_dimensions_take_any_image_size() -> None:
    ModelConfig.model_validate(fields(inputs=[{"name": "image", "datatype": "FP16", "shape": [3, -1, -1]}],
                                      preprocess={"size": [224, 224]}))


def test_preprocess_cannot_feed_a_bytes_input() -> None:
    found = problems(inputs=[{"name": "image", "datatype": "BYTES", "shape": [3, 8, 8]}], preprocess={"size": [8, 8]})
    assert found == {"preprocess": "produces pixel values, which input 'image' (BYTES) cannot hold"}


def test_preprocess_must_name_its_input_when_there_are_several() -> None:
    two = [IMAGE_INPUT, {"name": "mask", "datatype": "FP32", "shape": [8, 8]}]
    assert "name the one the image feeds" in problems(inputs=two, preprocess={"size": [8, 8]})["preprocess.input"]
    assert "must name one of the inputs" in problems(preprocess={"size": [8, 8], "input": "img"})["preprocess.input"]


def test_labels_must_match_the_number_of_scores() -> None:
    found = problems(postprocess={"labels": ["a", "b", "c"]})
    assert found == {"postprocess.labels": "has 3 labels, but output 'logits' holds 4 scores per item (shape [4])"}


def test_postprocess_must_name_an_output_of_scores() -> None:
    assert "must name one of the outputs" in problems(postprocess={"output": "probs"})["postprocess.output"]
    found = problems(outputs=[{"name": "text", "datatype": "BYTES", "shape": [1]}], postprocess={})
    assert found == {"postprocess.output": "output 'text' is BYTES, not scores"}


def test_tensor_names_must_be_unique() -> None:
    found = problems(inputs=[IMAGE_INPUT, IMAGE_INPUT],
                     outputs=[{"name": "y", "datatype": "FP32", "shape": [1]}] * 2)
    assert found == {"inputs.1.name": "input name 'image' is used twice",
                     "outputs.1.name": "output name 'y' is used twice"}


@pytest.mark.parametrize("artifact", ["../other/model.onnx", "/etc/model.onnx", "sub/../../model.onnx"])
def test_the_artifact_stays_inside_the_model_directory(artifact: str) -> None:
    assert "relative to the model directory" in problems(artifact=artifact)["artifact"]


def test_reserving_an_instance_needs_two() -> None:
    found = problems(batching={"reserve_instance_for_high": True})
    assert found == {"batching.reserve_instance_for_high": "needs instances >= 2; instances is 1"}


@pytest.mark.parametrize(("names", "field", "reason"), [
    (["head", "head"], "pytorch.lazy_submodules.1", "'head' is listed twice"),
    (["blocks", "blocks.0"], "pytorch.lazy_submodules.1", "'blocks.0' is inside 'blocks', which is lazy already; "
                                                           "list only the outer one"),
    (["head-1"], "pytorch.lazy_submodules.0", "'head-1' is not a dotted submodule name such as 'head' or 'blocks.3'"),
    (["head."], "pytorch.lazy_submodules.0", "'head.' is not a dotted submodule name such as 'head' or 'blocks.3'"),
])
def test_lazy_submodule_names_are_checked_at_load(names: list[str], field: str, reason: str) -> None:
    found = problems(runtime="pytorch", artifact="w.safetensors",
                     pytorch={"factory": "net:build", "lazy_submodules": names})
    assert found == {field: reason}


def test_lazy_submodules_may_name_module_list_items() -> None:
    config = ModelConfig.model_validate(fields(
        runtime="pytorch", artifact="w.safetensors", pytorch={"factory": "net:build", "lazy_submodules": ["blocks.3"]},
    ))
    assert config.pytorch is not None and config.pytorch.lazy_submodules == ["blocks.3"]


def test_lazy_submodules_belong_to_the_pytorch_runtime() -> None:
    found = problems(lazy_submodules=["head"])  # an onnx model
    assert found["lazy_submodules"].startswith("moved to 'pytorch.lazy_submodules' (a setting of the pytorch runtime")


def test_every_problem_is_reported_at_once() -> None:
    # Problems of single fields together; problems between fields together once each field is valid.
    assert set(problems(preprocess={"size": [8, 8], "mean": [1, 2]}, artifact="../m.onnx", instances=0)) == {
        "preprocess.mean", "artifact", "instances"}
    assert set(problems(postprocess={"labels": ["a"]}, batching={"reserve_instance_for_high": True},
                        preprocess={"size": [4, 4]})) == {
        "postprocess.labels", "batching.reserve_instance_for_high", "preprocess"}
