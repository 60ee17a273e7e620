"""Serving dtype and device resolution, mapping module results onto declared outputs, and the
ways a device fails (out of memory, device-side errors), injected by small modules that raise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from servewell.config.model import ModelConfig, TensorSpec
from servewell.runtimes import DeviceUnusableError, ModelLoadError
from servewell.runtimes.torch_execution import (
    TorchModuleRuntime,
    cpu_has_native_bf16,
    device_memory_share,
    is_device_failure,
    limit_device_memory,
    outputs_to_numpy,
    resolve_device,
    resolve_serving_dtype,
)
from servewell.runtimes.warmup import warm_up

CPU = torch.device("cpu")


def spec(name: str, datatype: str = "FP32") -> TensorSpec:
    return TensorSpec(name=name, datatype=datatype, shape=[-1])


def test_cpuinfo_flags_decide_native_bf16(tmp_path: Path) -> None:
    with_amx = tmp_path / "amx"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n")
    without = tmp_path / "plain"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_has_native_bf16(with_amx)
    assert not cpu_has_native_bf16(without)
    assert not cpu_has_native_bf16(tmp_path / "absent")


def test_explicit_dtypes_and_auto() -> None:
    assert resolve_serving_dtype("fp16", CPU) == torch.float16
    assert resolve_serving_dtype("bf16", CPU) == torch.bfloat16
    assert resolve_serving_dtype("fp32", CPU) == torch.float32
    assert resolve_serving_dtype("auto", torch.device("cuda")) == torch.float16
    assert resolve_serving_dtype("auto", CPU) == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        resolve_device("cuda:0")


def test_single_tensor_maps_to_the_only_output_in_its_declared_dtype() -> None:
    arrays = outputs_to_numpy(torch.tensor([1.5, 2.5], dtype=torch.bfloat16), [spec("y", "FP64")])
    assert arrays["y"].dtype == np.float64
    np.testing.assert_array_equal(arrays["y"], [1.5, 2.5])


def test_tuple_by_position_and_dict_by_name() -> None:
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    by_position = outputs_to_numpy((a, b), [spec("first"), spec("second")])
    by_name = outputs_to_numpy({"second": b, "first": a}, [spec("first"), spec("second")])
    assert by_position["second"][0] == by_name["second"][0] == 2.0


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (torch.zeros(1), "one tensor, model.yaml declares 2"),
        ((torch.zeros(1),), "returned 1 values"),
        ({"first": torch.zeros(1)}, r"missing outputs \['second'\]"),
        ((torch.zeros(1), 3), "'second' is a int"),
        ("text", "returned str"),
    ],
)
def test_results_that_do_not_fit_are_explained(result: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        outputs_to_numpy(result, [spec("first"), spec("second")])


def batched_config(max_batch_size: int = 8, **torchscript: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "tiny",
        "runtime": "torchscript",
        "artifact": "model.pt",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
        "max_batch_size": max_batch_size,
        "torchscript": torchscript,
    })


class OutOfMemoryAbove(torch.nn.Module):
    """Doubles its input, but runs out of (pretend) device memory above `rows` rows."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return x * 2


class FailingDevice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")


def test_a_batch_that_runs_out_of_memory_is_split_until_it_fits() -> None:
    runtime = TorchModuleRuntime(OutOfMemoryAbove(2), batched_config(), CPU, torch.float32)
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    assert runtime.oom_limited_batch_size is None

    outputs = runtime.run({"x": x})

    np.testing.assert_array_equal(outputs["y"], x * 2)
    assert runtime.oom_limited_batch_size == 2


def test_an_uneven_batch_splits_and_the_limit_only_goes_down() -> None:
    runtime = TorchModuleRuntime(OutOfMemoryAbove(3), batched_config(), CPU, torch.float32)
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    np.testing.assert_array_equal(runtime.run({"x": x})["y"], x * 2)  # 7 -> 3 + 4 -> 3 + 2 + 2
    assert runtime.oom_limited_batch_size == 3
    runtime.run({"x": x[:3]})  # fits whole: the limit stays
    assert runtime.oom_limited_batch_size == 3


def test_out_of_memory_on_one_item_is_raised() -> None:
    runtime = TorchModuleRuntime(OutOfMemoryAbove(0), batched_config(), CPU, torch.float32)
    with pytest.raises(torch.OutOfMemoryError):
        runtime.run({"x": np.zeros((4, 2), dtype=np.float32)})


def test_a_device_side_error_makes_the_runtime_unusable() -> None:
    runtime = TorchModuleRuntime(FailingDevice(), batched_config(), CPU, torch.float32)
    with pytest.raises(DeviceUnusableError, match="device-side assert"):
        runtime.run({"x": np.zeros((2, 2), dtype=np.float32)})
    with pytest.raises(DeviceUnusableError):  # without running the module again
        runtime.run({"x": np.zeros((2, 2), dtype=np.float32)})


def test_other_runtime_errors_are_not_device_failures() -> None:
    assert not is_device_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_device_failure(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_device_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_gpu_memory_fraction_is_set_for_cuda_devices_only() -> None:
    calls: list[tuple[float, int]] = []
    limit_device_memory(torch.device("cuda", 1), 0.5, lambda fraction, index: calls.append((fraction, index)))
    limit_device_memory(torch.device("cuda", 1), None, lambda fraction, index: calls.append((fraction, index)))
    limit_device_memory(CPU, 0.5, lambda fraction, index: calls.append((fraction, index)))
    assert calls == [(0.5, 1)]


def test_device_memory_limit_becomes_a_share_of_the_device() -> None:
    total = lambda: 16 << 30  # noqa: E731
    assert device_memory_share(None, 4 << 30, total) == 0.25
    assert device_memory_share(None, 32 << 30, total) == 1.0  # never above the whole device
    assert device_memory_share(0.1, 4 << 30, total) == 0.1  # the smaller cap wins
    assert device_memory_share(0.5, None, lambda: 1 // 0) == 0.5  # no limit: the device is not asked


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(1.001, 1.009, 2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def bf16_runtime_with_fp32_reference(builds: list[str]) -> TorchModuleRuntime:
    def reference() -> torch.nn.Module:
        builds.append("fp32")
        return Scaled().eval()

    return TorchModuleRuntime(
        Scaled().to(torch.bfloat16).eval(), batched_config(), CPU, torch.bfloat16, fp32_reference=reference
    )


def test_reduced_precision_beyond_tolerance_falls_back_to_fp32() -> None:
    builds: list[str] = []
    runtime = bf16_runtime_with_fp32_reference(builds)
    x = np.ones((1, 2), dtype=np.float32)

    check = runtime.check_against_fp32({"x": x}, tolerance=1e-12)

    assert check.fell_back_to_fp32 and check.checked_dtype == "bf16"
    assert check.max_relative_difference is not None and check.max_relative_difference > 1e-12
    assert runtime.serving_dtype == "fp32"
    np.testing.assert_array_equal(runtime.run({"x": x})["y"], Scaled()(torch.from_numpy(x)).detach().numpy())
    assert builds == ["fp32"]


def test_reduced_precision_within_tolerance_is_kept_and_checked_once() -> None:
    builds: list[str] = []
    runtime = bf16_runtime_with_fp32_reference(builds)

    check = runtime.check_against_fp32({"x": np.ones((1, 2), dtype=np.float32)}, tolerance=0.05)
    again = runtime.check_against_fp32({"x": np.ones((1, 2), dtype=np.float32)}, tolerance=0.05)

    assert not check.fell_back_to_fp32 and runtime.serving_dtype == "bf16"
    assert again.skipped_reason and builds == ["fp32"]


def test_warm_up_with_dtype_auto_reports_the_fallback() -> None:
    builds: list[str] = []
    runtime = bf16_runtime_with_fp32_reference(builds)
    config = batched_config(max_batch_size=2, dtype="auto", dtype_tolerance=1e-12)
    stages: list[str] = []

    report = warm_up(runtime, config, stages.append)

    assert report.serving_dtype == "fp32"
    assert report.precision_check is not None and report.precision_check.fell_back_to_fp32
    assert any("serving in fp32" in stage for stage in stages)
