"""Reading a model directory's model.yaml: every problem with the file and its field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from servewell.config.model_file import ModelConfigError, read_model_yaml
from servewell.config.problems import FieldProblem


def write(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.yaml").write_text(text)
    return directory


def valid_fields() -> dict[str, object]:
    return {"runtime": "onnx", "artifact": "model.onnx",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}


def test_a_valid_model_reads_with_its_directory_name(tmp_path: Path) -> None:
    directory = write(tmp_path / "tiny", yaml.safe_dump(valid_fields()))
    (directory / "model.onnx").write_bytes(b"onnx")
    assert read_model_yaml(directory).name == "tiny"


def test_each_problem_keeps_its_field(tmp_path: Path) -> None:
    directory = write(tmp_path / "old", yaml.safe_dump({**valid_fields(), "runtime": "torchscript", "freeze": True,
                                                        "max_batch_size": -1}))
    with pytest.raises(ModelConfigError) as caught:
        read_model_yaml(directory)
    assert caught.value.path == directory / "model.yaml"
    assert [p.field for p in caught.value.problems] == ["freeze", "max_batch_size"]
    assert str(caught.value).startswith(f"{directory / 'model.yaml'}: field 'freeze': moved to 'torchscript.freeze'; "
                                        "field 'max_batch_size': ")


def test_name_and_artifact_are_checked_against_the_directory(tmp_path: Path) -> None:
    directory = write(tmp_path / "tiny", yaml.safe_dump({**valid_fields(), "name": "other"}))
    with pytest.raises(ModelConfigError) as caught:
        read_model_yaml(directory)
    assert [p.field for p in caught.value.problems] == ["name", "artifact"]


def test_extra_files_are_relative_bounded_and_a_named_one_must_exist(tmp_path: Path) -> None:
    directory = write(tmp_path / "tiny", yaml.safe_dump({**valid_fields(),
                                                         "extra_files": ["labels.txt", "tok/*.json", "gone.json"]}))
    (directory / "model.onnx").write_bytes(b"onnx")
    (directory / "labels.txt").write_text("cat\n")
    with pytest.raises(ModelConfigError) as caught:
        read_model_yaml(directory)  # a pattern may match nothing; a named file must be there
    assert [p.field for p in caught.value.problems] == ["extra_files.2"]
    assert "gone.json does not exist" in caught.value.problems[0].reason
    write(directory, yaml.safe_dump({**valid_fields(), "extra_files": ["/etc/passwd", "../x", "ok", "a" * 1001]}))
    with pytest.raises(ModelConfigError) as caught:
        read_model_yaml(directory)
    assert [p.field for p in caught.value.problems] == ["extra_files.0", "extra_files.1", "extra_files.3"]
    write(directory, yaml.safe_dump({**valid_fields(), "extra_files": ["x"] * 257}))
    with pytest.raises(ModelConfigError, match="at most 256"):
        read_model_yaml(directory)


@pytest.mark.parametrize(("text", "reason"), [("- a\n- b\n", "expected a mapping of fields, got list"),
                                              ("a: [1\n", "not valid YAML")])
def test_a_file_that_is_not_a_mapping_is_a_top_level_problem(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ModelConfigError) as caught:
        read_model_yaml(write(tmp_path / "m", text))
    (problem,) = caught.value.problems
    assert problem.field == "(top level)" and problem.reason.startswith(reason)
    assert str(problem) == problem.reason


def test_field_problems_read_as_field_and_reason() -> None:
    assert str(FieldProblem("preprocess.mean", "has 2 values")) == "field 'preprocess.mean': has 2 values"
