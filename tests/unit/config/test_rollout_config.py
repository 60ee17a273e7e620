"""`traffic:` and `rollout:` in model.yaml, a version directory's model.yaml, and the admin's
TrafficPatch (config/rollout.py, config/model.py, config/model_file.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from servewell.config.model import ModelConfig
from servewell.config.model_file import ModelConfigError, read_model_yaml
from servewell.config.rollout import MAX_VERSIONS, TrafficPatch

BASE = {"name": "m", "runtime": "onnx", "artifact": "m.onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}


def problems(doc: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(doc)
    return {".".join(str(p) for p in e["loc"]): e["msg"] for e in caught.value.errors()}


def test_a_split_with_a_shadow_and_rules_loads_with_defaults() -> None:
    config = ModelConfig.model_validate({**BASE, "traffic": {"1": 95, "2": 5},
                                         "rollout": {"shadow": {"version": "3"}}})
    assert config.traffic == {"1": 95.0, "2": 5.0}
    assert config.rollout is not None and config.rollout.sticky == "route_key"
    assert config.rollout.shadow is not None and config.rollout.shadow.percent == 100.0
    rules = config.rollout.rollback
    assert (rules.window_s, rules.min_requests, rules.max_error_rate_increase, rules.max_p99_ratio) == (30, 20, 0.05, 2)
    assert rules.promote_after_requests is None  # promotion is off unless asked for


@pytest.mark.parametrize(("traffic", "needle"), [
    ({"1": 0, "2": 0}, "every weight is 0"),
    ({"1": -5}, "between 0 and 1000000"),
    ({"1": float("nan")}, "between 0 and 1000000"),
    ({"../x": 5}, "not a version name"),
    ({str(i): 1 for i in range(MAX_VERSIONS + 1)}, f"at most {MAX_VERSIONS}"),
])
def test_bad_weights_are_refused_with_the_reason(traffic: dict[str, float], needle: str) -> None:
    found = problems({**BASE, "traffic": traffic})
    assert needle in found["traffic"], found


def test_a_version_cannot_shadow_itself_and_a_pipeline_splits_nothing() -> None:
    assert "own version" in problems({**BASE, "rollout": {"shadow": {"version": "1"}}})["rollout.shadow.version"]
    pipeline = {"name": "p", "kind": "pipeline", "inputs": BASE["inputs"], "outputs": BASE["outputs"],
                "pipeline": {"steps": [{"name": "a", "model": "m", "inputs": {"x": "x"}}], "outputs": {"y": "a.y"}},
                "traffic": {"1": 1}}
    assert "one version" in problems(pipeline)["traffic"]


def test_a_version_a_split_names_must_be_a_safe_directory_name() -> None:
    assert "not a version name" in problems({**BASE, "traffic": {"1": 1, "../2": 1}})["traffic"]
    assert ModelConfig.model_validate({**BASE, "version": "1.0+build"}).version == "1.0+build"  # alone: as before


def write(directory: Path, **fields: Any) -> None:
    directory.mkdir(parents=True)
    (directory / "m.onnx").write_bytes(b"onnx")
    doc = {key: value for key, value in {**BASE, **fields}.items() if value is not None}
    (directory / "model.yaml").write_text(yaml.safe_dump(doc))


def test_a_version_directory_takes_the_model_name_and_its_directory_as_version(tmp_path: Path) -> None:
    write(tmp_path / "m" / "versions" / "7", name=None)
    config = read_model_yaml(tmp_path / "m" / "versions" / "7", version_of="m")
    assert (config.name, config.version) == ("m", "7")


def test_a_version_directory_refuses_another_version_or_a_split_of_its_own(tmp_path: Path) -> None:
    write(tmp_path / "m" / "versions" / "7", version="8", traffic={"8": 1})
    with pytest.raises(ModelConfigError) as caught:
        read_model_yaml(tmp_path / "m" / "versions" / "7", version_of="m")
    fields = {p.field for p in caught.value.problems}
    assert fields == {"version", "traffic"}, caught.value


def test_the_admin_patch_is_strict_and_never_empty() -> None:
    assert TrafficPatch.model_validate({"traffic": {"1": 50, "2": 50.5}}).traffic == {"1": 50.0, "2": 50.5}
    assert TrafficPatch.model_validate({"traffic": None}).model_fields_set == {"traffic"}
    for bad in ({}, {"traffic": {"1": "50"}}, {"traffic": {"1": True}}, {"shadow_percent": 101},
                {"traffic": {"1": 0}}, {"weights": {"1": 1}}, {"traffic": {"x" * 65: 1}}):
        with pytest.raises(ValidationError):
            TrafficPatch.model_validate(bad)
    assert TrafficPatch.model_json_schema()["minProperties"] == 1
