"""The budget a model pool evicts against: host and device memory counted apart, a model's own
reservation never counted against itself, a model's measured memory counted once it is more than
its estimate, and refusals that carry the numbers (one that could never fit says so)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from servewell.config.model import ModelConfig
from servewell.config.runtimes import runtime_descriptor
from servewell.engine.memory_budget import (
    MemoryBudget,
    MemoryEstimate,
    estimate_model_memory,
    measure_processes,
    proportional_set_bytes,
)

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
    assert gpu.total_bytes == 2 * runtime_descriptor("onnx").base_bytes  # the host keeps only the runtimes


def test_a_model_measured_above_its_estimate_counts_its_measurement() -> None:
    budget = MemoryBudget(100 * MiB)
    budget.reserve("a", estimate(20), "a")
    budget.measure("a", 70 * MiB)  # a python model's own allocations: unknown until it loaded
    assert budget.held_bytes("a") == 70 * MiB and budget.used_bytes == 70 * MiB
    assert budget.estimated_bytes == 20 * MiB and budget.measured_bytes == 70 * MiB
    assert budget.shortfall("b", estimate(40)) == (10 * MiB, 0)  # by the estimate alone it would fit
    with pytest.raises(MemoryError, match="only 30 MiB"):
        budget.reserve("b", estimate(40), "model 'b'")


def test_a_measurement_below_the_estimate_leaves_the_estimate_counted() -> None:
    budget = MemoryBudget(100 * MiB)
    budget.reserve("a", estimate(60), "a")
    budget.measure("a", 15 * MiB)
    assert budget.held_bytes("a") == 60 * MiB and budget.measured_by("a") == 15 * MiB


def test_a_measurement_known_before_a_reload_is_what_the_reload_must_fit() -> None:
    budget = MemoryBudget(100 * MiB)
    budget.reserve("other", estimate(50), "other")
    budget.measure("again", 80 * MiB)  # what this model held when it last ran
    assert budget.shortfall("again", estimate(20)) == (30 * MiB, 0)
    with pytest.raises(MemoryError, match="measured at 80 MiB"):
        budget.reserve("again", estimate(20), "model 'again'")
    budget.release("again")
    assert budget.measured_by("again") is None and budget.shortfall("again", estimate(20)) == (0, 0)


def test_a_model_bigger_than_the_whole_budget_is_refused_as_never_fitting() -> None:
    budget = MemoryBudget(100 * MiB, device_total_bytes=50 * MiB)
    budget.reserve("pinned", estimate(64), "pinned")
    assert budget.beyond_whole_budget(estimate(90), "model 'm'") is None  # fits once the others are gone
    never = budget.beyond_whole_budget(estimate(130), "model 'big'")
    assert never is not None and "130 MiB" in never and "whole 100 MiB memory budget" in never
    with pytest.raises(MemoryError) as refused:
        budget.reserve("big", estimate(130), "model 'big'", " (64 MiB held by pinned models)")
    message = str(refused.value)
    assert "whole 100 MiB memory budget" in message and "left" not in message and "pinned" not in message
    measured = budget.beyond_whole_budget(estimate(20), "model 'm'", measured_bytes=120 * MiB)
    assert measured is not None and "measured at 120 MiB" in measured
    device = budget.beyond_whole_budget(estimate(10, device_mib=60), "model 'gpu'")
    assert device is not None and "whole 50 MiB device memory budget" in device


def test_the_proportional_set_of_a_process_counts_the_pages_it_touched() -> None:
    before = proportional_set_bytes(os.getpid())
    ballast = np.ones(64 * MiB // 8)  # every page written: resident and private
    after = proportional_set_bytes(os.getpid())
    assert before is not None and after is not None and after - before >= 60 * MiB, (before, after)
    assert measure_processes((os.getpid(),)) is not None
    del ballast
    assert proportional_set_bytes(2**22 + 12345) is None  # beyond pid_max: no such process
    assert measure_processes((os.getpid(), 2**22 + 12345)) is None  # a partial figure would undercount
