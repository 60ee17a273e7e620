"""A pipeline's model.yaml, checked from the file alone (config/pipeline.py, config/model.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servewell.config.model import ModelConfig

SCALAR = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
          "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}


def pipeline(steps: list[dict[str, Any]], outputs: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"name": "p", "kind": "pipeline", **SCALAR, "pipeline": {"steps": steps, "outputs": outputs}, **fields}


def problems(doc: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(doc)
    return {".".join(str(p) for p in e["loc"]): e["msg"] for e in caught.value.errors()}


def test_a_pipeline_gets_its_runtime_and_no_artifact() -> None:
    config = ModelConfig.model_validate(pipeline([{"name": "a", "model": "m", "inputs": {"x": "x"}}], {"y": "a.y"}))
    assert (config.kind, config.runtime, config.artifact) == ("pipeline", "pipeline", "model.yaml")
    assert config.pipeline is not None and config.pipeline.alternatives("y") == ["a.y"]


def test_a_pipeline_refuses_an_artifact_or_runtime_of_its_own() -> None:
    found = problems(pipeline([{"name": "a", "model": "m", "inputs": {"x": "x"}}], {"y": "a.y"},
                              runtime="onnx", artifact="m.onnx"))
    assert set(found) == {"runtime", "artifact"}
    assert "a pipeline has none" in found["artifact"]


def test_sources_must_come_from_inputs_or_earlier_steps() -> None:
    found = problems(pipeline([{"name": "a", "model": "m", "inputs": {"x": "b.y"}},
                               {"name": "b", "model": "m", "inputs": {"x": "x"}}], {"y": "b.y"}))
    assert "names step 'b', which is not an earlier step" in found["pipeline.steps.0.inputs.x"]


def test_a_step_name_used_twice_and_a_bad_source_are_named() -> None:
    found = problems(pipeline([{"name": "a", "model": "m", "inputs": {"x": "x"}},
                               {"name": "a", "model": "m", "inputs": {"x": "a.y.z"}}], {"y": "a.y"}))
    assert "used twice" in found["pipeline.steps.1.name"]
    assert "is not a source" in found["pipeline.steps.1.inputs.x"]


def test_an_output_must_come_from_a_step_and_be_declared() -> None:
    found = problems(pipeline([{"name": "a", "model": "m", "inputs": {"x": "x"}}], {"y": "x", "extra": "a.y"}))
    assert "must be a step's output" in found["pipeline.outputs.y"]


def test_declared_outputs_and_inputs_must_match_the_wiring() -> None:
    found = problems(pipeline([{"name": "a", "model": "m", "inputs": {"x": "page"}}], {"z": "a.y"}))
    assert "'page' is not an input of the pipeline" in found["pipeline.steps.0.inputs.x"]
    assert "is not a declared output" in found["pipeline.outputs.z"]
    assert "declared output 'y' has no source here" in found["pipeline.outputs"]


def test_a_switch_condition_names_a_known_tensor_and_outputs_may_list_alternatives() -> None:
    doc = pipeline([{"name": "a", "model": "m", "inputs": {"x": "x"}, "when": {"tensor": "x", "equals": 1}},
                    {"name": "b", "model": "m", "inputs": {"x": "x"}, "when": {"tensor": "a.y", "equals": 0}}],
                   {"y": ["a.y", "b.y"]})
    config = ModelConfig.model_validate(doc)
    assert config.pipeline is not None and config.pipeline.alternatives("y") == ["a.y", "b.y"]
    doc["pipeline"]["steps"][0]["when"]["tensor"] = "c.y"
    assert "not an earlier step" in problems(doc)["pipeline.steps.0.when.tensor"]


def test_a_pipeline_has_no_cache_of_its_own_and_a_model_no_pipeline_section() -> None:
    found = problems(pipeline([{"name": "a", "model": "m", "inputs": {"x": "x"}}], {"y": "a.y"},
                              cache={"max_bytes": 1024}))
    assert "give its step models one" in found["cache"]
    found = problems({"name": "m", "runtime": "onnx", "artifact": "m.onnx", **SCALAR,
                      "pipeline": {"steps": [{"name": "a", "model": "m", "inputs": {"x": "x"}}],
                                   "outputs": {"y": "a.y"}}})
    assert "needs kind: pipeline" in found["pipeline"]


def test_a_python_model_needs_its_section_with_a_module_and_class() -> None:
    base = {"name": "m", "runtime": "python", "artifact": "step.py", **SCALAR}
    assert "runtime python needs this section" in problems(base)["python"]
    assert "must look like 'module:Class'" in problems({**base, "python": {"entry": "step"}})["python.entry"]
    config = ModelConfig.model_validate({**base, "python": {"entry": "step:Step", "settings": {"k": 1}}})
    assert config.python is not None and config.python.settings == {"k": 1}


@pytest.mark.parametrize("count", [0, 33])
def test_the_number_of_steps_is_bounded(count: int) -> None:
    steps = [{"name": f"s{i}", "model": "m", "inputs": {"x": "x"}} for i in range(count)]
    assert "pipeline.steps" in problems(pipeline(steps, {"y": "s0.y"}))
