"""The runtime registry (config/runtimes.py): a runtime is one descriptor registered in one place, and
model.yaml's validation, the memory estimate, model metadata and the snapshot's files all follow it.
The toy runtime of tests/support/toy_runtime.py is registered here through `register_runtime` alone."""

from __future__ import annotations

import importlib.util
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servewell.api.model_document import model_document
from servewell.config.model import ModelConfig
from servewell.config.problems import field_problems
from servewell.config.runtimes import (
    BUILT_IN,
    RuntimeDescriptor,
    find_runtime,
    register_runtime,
    resolve,
    runtime_descriptor,
    runtimes,
    unregister_runtime,
)
from servewell.engine.memory_budget import WORKING_SET_FACTOR, estimate_model_memory
from servewell.engine.model_files import model_files
from servewell.engine.protocol import ModelView
from toy_runtime import TOY, WEIGHT_BYTES_PER_FILE_BYTE, ToySettings, toy_model_yaml


@pytest.fixture
def toy() -> Iterator[RuntimeDescriptor]:
    """The toy runtime, registered for one test (and gone after it)."""
    register_runtime(TOY)
    yield TOY
    unregister_runtime(TOY.name)


def problems(document: dict[str, Any]) -> dict[str, str]:
    """Field -> reason of every problem of a model.yaml that must be invalid."""
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(document)
    return {p.field: p.reason for p in field_problems(caught.value)}


def onnx_model_yaml(**changes: Any) -> dict[str, Any]:
    return toy_model_yaml(runtime="onnx", artifact="model.onnx", **changes)


def test_an_unregistered_runtime_and_its_section_are_refused() -> None:
    assert find_runtime("toy") is None
    found = problems(toy_model_yaml(factor=3.0))
    assert found == {"runtime": "unknown runtime 'toy'; use onnx, torchscript, pytorch or python",
                     "toy": "Extra inputs are not permitted"}


def test_a_registered_runtime_is_a_valid_model_yaml_runtime_with_its_section(toy: RuntimeDescriptor) -> None:
    config = ModelConfig.model_validate(toy_model_yaml(factor=3.0))
    assert config.runtime == "toy" and config.runtime_descriptor == toy
    assert config.runtime_settings == ToySettings(factor=3.0)
    assert config.model_dump()["toy"] == {"factor": 3.0}  # written back as model.yaml has it
    assert ModelConfig.model_validate_json(config.model_dump_json()) == config
    # A section that may be left out holds its defaults (needs_section is empty).
    assert ModelConfig.model_validate(toy_model_yaml()).runtime_settings == ToySettings()
    assert "use onnx, torchscript, pytorch, python or toy" in problems(toy_model_yaml(runtime="tf"))["runtime"]


def test_the_section_is_checked_with_the_registered_class(toy: RuntimeDescriptor) -> None:
    found = problems(toy_model_yaml(toy={"factor": "lots", "factr": 2}))
    assert set(found) == {"toy.factor", "toy.factr"}
    assert found["toy.factr"] == "Extra inputs are not permitted"


def test_a_runtime_section_for_another_runtime_stays_an_error(toy: RuntimeDescriptor) -> None:
    assert problems(onnx_model_yaml(toy={"factor": 3.0})) == {
        "toy": "settings of runtime toy; this model's runtime is onnx (remove the section or change runtime)"}
    assert problems(toy_model_yaml(onnx={"spin_wait": True})) == {
        "onnx": "settings of runtime onnx; this model's runtime is toy (remove the section or change runtime)"}
    assert problems(toy_model_yaml(dtype="bf16"))["dtype"].endswith("only; this model's runtime is toy)")


def test_metadata_names_the_runtime_s_triton_platform_and_backend(toy: RuntimeDescriptor) -> None:
    config = ModelConfig.model_validate(toy_model_yaml())
    doc = model_document(ModelView("toy", config.version, "ready", None, config, 1.0, 0, 0, (), None))
    assert (doc.platform, doc.backend) == ("toy_platform", "toy_backend")


def test_the_memory_estimate_is_the_runtime_s_base_and_its_own_weight_estimate(
        toy: RuntimeDescriptor, tmp_path: Path) -> None:
    (tmp_path / "toy.txt").write_bytes(b"0" * 1000)
    config = ModelConfig.model_validate(toy_model_yaml(instances=2))
    estimate = estimate_model_memory(config, tmp_path)
    weights = 1000 * WEIGHT_BYTES_PER_FILE_BYTE  # the default would have read 1000, the file's size
    assert estimate.weight_bytes == weights and estimate.basis == "toy estimate, 10x toy.txt"
    assert estimate.per_instance_bytes == int(weights * WORKING_SET_FACTOR) + toy.base_bytes
    assert estimate.total_bytes == 2 * estimate.per_instance_bytes


def test_the_snapshot_takes_the_model_s_code_only_for_a_runtime_that_imports_it(
        toy: RuntimeDescriptor, tmp_path: Path) -> None:
    for name in ("toy.txt", "helpers.py"):
        (tmp_path / name).write_text("")
    assert model_files(ModelConfig.model_validate(toy_model_yaml()), tmp_path) == ["model.yaml", "toy.txt"]
    assert not toy.model_code and runtime_descriptor("python").model_code


def test_the_reference_documents_the_section_of_every_registered_runtime(toy: RuntimeDescriptor) -> None:
    sections = ModelConfig.section_fields()
    assert list(sections) == ["onnx", "torchscript", "pytorch", "python", "toy"]
    assert "Settings of runtime toy, where the model multiplies its input" in str(sections["toy"].description)
    assert "needs this section, with at least 'factory: module:callable'" in str(sections["pytorch"].description)


def test_a_config_keeps_its_runtime_where_the_registry_does_not_know_it(toy: RuntimeDescriptor) -> None:
    # What a worker started for the model relies on: it unpickles the config in a process that never
    # registered the runtime.
    pickled = pickle.dumps(ModelConfig.model_validate(toy_model_yaml(factor=5.0)))
    unregister_runtime("toy")
    config = pickle.loads(pickled)
    assert find_runtime("toy") is None
    assert config.runtime_descriptor == toy and config.runtime_settings == ToySettings(factor=5.0)
    register_runtime(toy)  # for the fixture's end


def test_registration_refuses_a_name_taken_or_malformed(toy: RuntimeDescriptor) -> None:
    assert register_runtime(toy) is toy  # the same descriptor again changes nothing
    for name, match in (("toy", "registered already"), ("onnx", "registered already"),
                        ("inputs", "field of model.yaml"), ("Toy-2", "lower-case")):
        with pytest.raises(ValueError, match=match):
            register_runtime(RuntimeDescriptor(name, "another", backend="toy_runtime"))
    with pytest.raises(ValueError, match="not a 'module:function' path"):
        register_runtime(RuntimeDescriptor("toy2", "bad path", backend="toy_runtime", weight_bytes="toy_runtime"))
    with pytest.raises(ValueError, match="built in"):
        unregister_runtime("onnx")
    assert [runtime.name for runtime in runtimes()] == [*(runtime.name for runtime in BUILT_IN), "toy"]


def test_every_built_in_runtime_names_what_exists() -> None:
    # What the engine and model.yaml call is resolved here; the backends and the checks import a
    # framework (they run in a worker or a child process), so only their modules' files are looked up.
    for runtime in BUILT_IN:
        assert runtime.triton_platform, runtime.name
        if runtime.in_worker:
            assert importlib.util.find_spec(runtime.backend) is not None, runtime.backend
            assert runtime.base_bytes > 0, runtime.name
        for path in (runtime.model_check, runtime.artifact_files, runtime.weight_bytes):
            assert not path or callable(resolve(path)), path
        if runtime.check is not None:
            assert importlib.util.find_spec(runtime.check.function.partition(":")[0]) is not None, runtime.check
