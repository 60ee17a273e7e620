"""The budget a model pool evicts against: host and device memory counted apart, a model's own
reservation never counted against itself, and refusals that carry the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell.config.model import ModelConfig
from servewell.engine.memory_budget import RUNTIME_BASE_BYTES, MemoryBudget, MemoryEstimate, estimate_model_memory

MiB = 1 << 20


def estimate(host_mib: int, device_mib: int = 0) -> MemoryEstimate:
    return MemoryEstimate(0, host_mib * MiB, host_mib * MiB, "test", device_mib * MiB)


def test_the_shortfall_counts_what_others_hold_not_the_owners_own_share() -> None:
    budget = MemoryBudget(100 * MiB)
    budget.reserve("a", estimate(60), "a")
    assert budget.shortfall("b", estimate(50)) == (10 * MiB, 0)
    assert budget.shortfall("a", estimate(90)) == (0, 0)  # a's 60 are its own: a reload of a fits in 100
    budget.release("a")
    assert budget.shortfall("b", estimate(50)) == (0, 0)


def test_device_memory_is_budgeted_apart_from_host_memory() -> None:
    budget = MemoryBudget(1000 * MiB, device_total_bytes=100 * MiB)
    budget.reserve("a", estimate(10, device_mib=80), "a")
    assert budget.shortfall("b", estimate(10, device_mib=30)) == (0, 10 * MiB)
    with pytest.raises(MemoryError, match="device memory budget"):
        budget.reserve("b", estimate(10, device_mib=30), "model 'b'")
    assert budget.device_used_bytes == 80 * MiB and budget.used_bytes == 10 * MiB


def test_a_host_refusal_names_the_model_the_numbers_and_what_holds_the_rest() -> None:
    budget = MemoryBudget(100 * MiB)
    budget.reserve("pinned", estimate(70), "pinned")
    with pytest.raises(MemoryError) as refused:
        budget.reserve("big", estimate(50), "model 'big'", " (70 MiB held by pinned models)")
    message = str(refused.value)
    assert "model 'big'" in message and "50 MiB" in message and "30 MiB" in message and "pinned" in message


def test_a_gpu_models_weights_are_estimated_as_device_memory(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"\0" * (8 * MiB))
    common = {"name": "m", "runtime": "onnx", "artifact": "model.onnx", "instances": 2,
              "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}
    cpu = estimate_model_memory(ModelConfig.model_validate(common), tmp_path)
    gpu = estimate_model_memory(ModelConfig.model_validate({**common, "device": "cuda"}), tmp_path)
    assert cpu.device_bytes == 0 and cpu.total_bytes > 2 * 8 * MiB
    assert gpu.device_bytes == 2 * 10 * MiB  # weights x 1.25 working set, per instance
    assert gpu.total_bytes == 2 * RUNTIME_BASE_BYTES["onnx"]  # the host keeps only the runtimes
