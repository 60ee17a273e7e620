"""Per-runtime sections of model.yaml: each runtime's knobs in its own section, old flat keys refused."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from servewell.config.model import ModelConfig, OnnxSettings, TorchScriptSettings
from servewell.config.problems import field_problems
from servewell.config.runtime_sections import MOVED_TO_SECTIONS


def fields(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "m", "runtime": "onnx", "artifact": "model.onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
    }
    return {**base, **changes}


def problems(**changes: Any) -> dict[str, str]:
    """Field -> reason of every problem of a config that must be invalid."""
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(fields(**changes))
    return {p.field: p.reason for p in field_problems(caught.value)}


@pytest.mark.parametrize(("key", "runtime", "section"), [
    ("spin_wait", "onnx", "onnx"),
    ("freeze", "torchscript", "torchscript"),
    ("optimize_for_inference", "torchscript", "torchscript"),
    ("dtype", "torchscript", "torchscript"),
    ("dtype", "pytorch", "pytorch"),
    ("dtype_tolerance", "pytorch", "pytorch"),
    ("gpu_memory_fraction", "torchscript", "torchscript"),
    ("factory", "pytorch", "pytorch"),
    ("factory_kwargs", "pytorch", "pytorch"),
    ("unsafe_allow_pickle", "pytorch", "pytorch"),
    ("lazy_submodules", "pytorch", "pytorch"),
])
def test_a_flat_runtime_key_names_the_section_it_moved_to(key: str, runtime: str, section: str) -> None:
    changes: dict[str, Any] = {"runtime": runtime, key: True}
    if runtime == "pytorch":
        changes["pytorch"] = {"factory": "net:build"}
    assert problems(**changes) == {key: f"moved to '{section}.{key}'"}


def test_every_section_field_is_covered_by_the_moved_keys() -> None:
    assert set(MOVED_TO_SECTIONS) == {
        "spin_wait", "freeze", "optimize_for_inference", "dtype", "dtype_tolerance", "gpu_memory_fraction",
        "factory", "factory_kwargs", "unsafe_allow_pickle", "lazy_submodules",
    }


def test_a_flat_key_of_another_runtime_names_its_runtime() -> None:
    found = problems(dtype="bf16")  # an onnx model
    assert found["dtype"].startswith("moved to 'torchscript.dtype' or 'pytorch.dtype'")
    assert "this model's runtime is onnx" in found["dtype"]


def test_moved_keys_are_reported_with_every_other_problem() -> None:
    found = problems(runtime="torchscript", freeze=True, max_batch_size="lots")
    assert set(found) == {"freeze", "max_batch_size"}


def test_a_section_for_another_runtime_is_an_error() -> None:
    found = problems(torchscript={"freeze": True})
    assert found == {"torchscript": "settings of runtime torchscript; this model's runtime is onnx "
                                    "(remove the section or change runtime)"}


def test_the_pytorch_runtime_needs_its_section() -> None:
    assert "needs this section" in problems(runtime="pytorch")["pytorch"]


def test_a_factory_must_be_module_colon_callable() -> None:
    found = problems(runtime="pytorch", pytorch={"factory": "net.build"})
    assert found == {"pytorch.factory": "'net.build' must look like 'module:callable' (e.g. 'my_model:build')"}


def test_section_fields_are_checked_in_their_section() -> None:
    found = problems(runtime="torchscript", torchscript={"dtype": "int8", "frezze": True})
    assert set(found) == {"torchscript.dtype", "torchscript.frezze"}


def test_optional_sections_are_filled_with_defaults() -> None:
    onnx = ModelConfig.model_validate(fields())
    assert onnx.onnx == OnnxSettings() and onnx.torch_settings is None
    scripted = ModelConfig.model_validate(fields(runtime="torchscript", artifact="model.pt"))
    assert scripted.torchscript == TorchScriptSettings() and scripted.torch_settings == TorchScriptSettings()


def test_torch_settings_are_the_section_of_the_model_s_torch_runtime() -> None:
    config = ModelConfig.model_validate(fields(
        runtime="pytorch", artifact="model.safetensors", pytorch={"factory": "net:build", "dtype": "bf16"},
    ))
    assert config.torch_settings is config.pytorch and config.torch_settings is not None
    assert config.torch_settings.dtype == "bf16"


def test_safetensors_needs_the_pytorch_runtime() -> None:
    assert "needs runtime pytorch" in problems(runtime="torchscript", artifact="model.safetensors")["artifact"]


def test_gpu_memory_fraction_needs_a_cuda_device() -> None:
    found = problems(runtime="torchscript", artifact="model.pt", torchscript={"gpu_memory_fraction": 0.5})
    assert found == {"torchscript.gpu_memory_fraction": "applies to CUDA devices; device is cpu"}
    ModelConfig.model_validate(fields(runtime="torchscript", artifact="model.pt", device="cuda:0",
                                      torchscript={"gpu_memory_fraction": 0.5}))


def test_host_and_device_memory_limits_are_named_apart() -> None:
    config = ModelConfig.model_validate(fields(device="cuda", host_memory_limit_bytes=2 << 30,
                                               device_memory_limit_bytes=8 << 30))
    assert (config.host_memory_limit_bytes, config.device_memory_limit_bytes) == (2 << 30, 8 << 30)
    assert problems(device_memory_limit_bytes=1 << 30) == {
        "device_memory_limit_bytes": "applies to CUDA devices; device is cpu (host memory is host_memory_limit_bytes)"}
    both = problems(runtime="torchscript", artifact="model.pt", device="cuda:0", device_memory_limit_bytes=1 << 30,
                    torchscript={"gpu_memory_fraction": 0.5})
    assert both == {"device_memory_limit_bytes": "and torchscript.gpu_memory_fraction both cap device memory; "
                                                 "give one of them"}


def test_memory_limit_bytes_is_read_as_the_deprecated_name_of_the_host_limit(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="servewell.config"):
        config = ModelConfig.model_validate(fields(memory_limit_bytes=1 << 30))
    assert config.host_memory_limit_bytes == 1 << 30 and config.device_memory_limit_bytes is None
    assert "memory_limit_bytes is deprecated; it means host_memory_limit_bytes" in caplog.text
    assert "memory_limit_bytes" not in config.model_dump()  # one name from here on
    found = problems(memory_limit_bytes=1 << 30, host_memory_limit_bytes=2 << 30)
    assert "deprecated name of host_memory_limit_bytes" in found["memory_limit_bytes"]


def test_a_validated_config_survives_a_json_round_trip() -> None:
    config = ModelConfig.model_validate(fields(
        runtime="pytorch", artifact="w.safetensors", pytorch={"factory": "net:build", "lazy_submodules": ["head"]},
    ))
    assert ModelConfig.model_validate_json(config.model_dump_json()) == config
