"""Serving dtype and device resolution, and mapping module results onto declared outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from servewell.config.model import TensorSpec
from servewell.runtimes import ModelLoadError
from servewell.runtimes.torch_execution import (
    cpu_has_native_bf16,
    outputs_to_numpy,
    resolve_device,
    resolve_serving_dtype,
)

CPU = torch.device("cpu")


def spec(name: str, datatype: str = "FP32") -> TensorSpec:
    return TensorSpec(name=name, datatype=datatype, shape=[-1])  # type: ignore[arg-type]


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
