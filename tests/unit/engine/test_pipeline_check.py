"""A pipeline against its step models' configs (engine/pipeline_check.py) and its run order
(engine/pipeline.py's levels): every mismatch named, fan-outs grouped."""

from __future__ import annotations

from typing import Any

from servewell.config.model import ModelConfig
from servewell.engine.pipeline import _levels
from servewell.engine.pipeline_check import check_pipeline, shapes_fit


def model(name: str, inputs: dict[str, tuple[str, list[int]]], outputs: dict[str, tuple[str, list[int]]],
          max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": name, "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": max_batch_size,
        "inputs": [{"name": n, "datatype": d, "shape": s} for n, (d, s) in inputs.items()],
        "outputs": [{"name": n, "datatype": d, "shape": s} for n, (d, s) in outputs.items()]})


CROP = model("crop", {"page": ("FP32", [1, -1, -1])}, {"digit": ("FP32", [1, 8, 8]), "box": ("INT64", [4])})
CLASSIFY = model("classify", {"input": ("FP32", [1, 8, 8])}, {"logits": ("FP32", [10])})
MODELS = {"crop": CROP, "classify": CLASSIFY}


def configs(name: str) -> tuple[ModelConfig | None, str]:
    found = MODELS.get(name)
    return (found, "") if found is not None else (None, f"the repository has no model {name!r}")


def pipeline(steps: list[dict[str, Any]], outputs: dict[str, Any], out_specs: dict[str, tuple[str, list[int]]],
             max_batch_size: int = 4) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "p", "kind": "pipeline", "max_batch_size": max_batch_size,
        "inputs": [{"name": "page", "datatype": "FP32", "shape": [1, 64, 64]}],
        "outputs": [{"name": n, "datatype": d, "shape": s} for n, (d, s) in out_specs.items()],
        "pipeline": {"steps": steps, "outputs": outputs}})


GOOD_STEPS = [{"name": "crop", "model": "crop", "inputs": {"page": "page"}},
              {"name": "cls", "model": "classify", "inputs": {"input": "crop.digit"}}]


def test_a_pipeline_that_fits_has_no_problem() -> None:
    config = pipeline(GOOD_STEPS, {"logits": "cls.logits", "box": "crop.box"},
                      {"logits": ("FP32", [10]), "box": ("INT64", [4])})
    assert check_pipeline(config, configs) == []


def test_every_mismatch_is_named_with_both_sides() -> None:
    steps = [{"name": "crop", "model": "crop", "inputs": {"page": "page", "extra": "page"}},
             {"name": "cls", "model": "classify", "inputs": {"input": "crop.box"}},
             {"name": "gone", "model": "missing", "inputs": {"x": "cls.logits"}}]
    config = pipeline(steps, {"logits": "cls.logits", "box": "crop.digit"},
                      {"logits": ("FP16", [10]), "box": ("INT64", [4])}, max_batch_size=16)
    problems = check_pipeline(config, configs)
    assert "step 'crop' (model 'crop') has no input 'extra'; its inputs are ['page']" in problems
    assert "step 'cls' (model 'classify') input 'input' is FP32 [1, 8, 8], but its source 'crop.box' is INT64 [4]" \
        in problems
    assert "step 'gone' (model 'missing'): the repository has no model 'missing'" in problems
    assert "output 'logits' is declared FP16 [10], but its source 'cls.logits' gives FP32 [10]" in problems
    assert "output 'box' is declared INT64 [4], but its source 'crop.digit' gives FP32 [1, 8, 8]" in problems
    assert any("takes batches of at most 8 rows; the pipeline's max_batch_size 16" in p for p in problems)


def test_an_unfed_input_and_an_unknown_output_are_named() -> None:
    steps: list[dict[str, Any]] = [{"name": "crop", "model": "crop", "inputs": {"page": "page"}},
                                   {"name": "cls", "model": "classify", "inputs": {"input": "crop.digits"}}]
    problems = check_pipeline(pipeline(steps, {"logits": "cls.logits"}, {"logits": ("FP32", [10])}), configs)
    assert problems == ["step 'cls' (model 'classify') input 'input': step 'crop' (model 'crop') has no output "
                        "'digits'; its outputs are ['box', 'digit']"]
    steps[1]["inputs"] = {"other": "crop.digit"}
    problems = check_pipeline(pipeline(steps, {"logits": "cls.logits"}, {"logits": ("FP32", [10])}), configs)
    assert "step 'cls' (model 'classify'): input 'input' is not fed (add it to the step's inputs)" in problems


def test_an_output_wired_to_a_step_output_that_does_not_exist_is_refused() -> None:
    """Issue 45 W6: `w: m.nope` loaded ready and every request got a 422 blaming the client."""
    config = pipeline(GOOD_STEPS, {"logits": "cls.logits", "box": ["crop.nope", "crop.box"]},
                      {"logits": ("FP32", [10]), "box": ("INT64", [4])})
    assert check_pipeline(config, configs) == [
        "output 'box': step 'crop' (model 'crop') has no output 'nope'; its outputs are ['box', 'digit']"]


def test_shapes_fit_where_any_size_meets_a_size() -> None:
    assert shapes_fit([1, -1, -1], [1, 64, 64]) and shapes_fit([-1], [3])
    assert not shapes_fit([1, 8, 8], [1, 8]) and not shapes_fit([3], [4])


def test_steps_whose_sources_are_ready_run_together() -> None:
    config = pipeline([{"name": "a", "model": "crop", "inputs": {"page": "page"}},
                       {"name": "b", "model": "crop", "inputs": {"page": "page"}},
                       {"name": "c", "model": "classify", "inputs": {"input": "a.digit"}},
                       {"name": "d", "model": "classify", "inputs": {"input": "b.digit"},
                        "when": {"tensor": "c.logits", "equals": 0}}],
                      {"logits": "d.logits"}, {"logits": ("FP32", [10])})
    assert config.pipeline is not None
    assert [[s.name for s in level] for level in _levels(config.pipeline.steps)] == [["a", "b"], ["c"], ["d"]]
