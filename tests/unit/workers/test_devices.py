"""The engine chooses each instance's device (the worker only applies it): round-robin over the
visible GPUs, counted without a framework, and without real GPUs here."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell.workers.devices import choose_device, visible_gpu_count


def test_cpu_stays_cpu_whatever_the_gpus() -> None:
    assert [choose_device("cpu", i, gpu_count=4) for i in range(3)] == ["cpu"] * 3


def test_cuda_without_a_visible_gpu_is_left_to_the_runtime_to_refuse() -> None:
    assert choose_device("cuda", 0, gpu_count=0) == "cuda"


def test_cuda_instances_go_round_robin_over_the_gpus() -> None:
    assert [choose_device("cuda", i, gpu_count=2) for i in range(5)] == [
        "cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert [choose_device("cuda", i, gpu_count=1) for i in range(2)] == ["cuda:0", "cuda:0"]


def test_an_explicit_gpu_is_kept_for_every_instance() -> None:
    assert [choose_device("cuda:3", i, gpu_count=8) for i in range(3)] == ["cuda:3"] * 3


def gpus(tmp_path: Path, count: int) -> Path:
    for i in range(count):
        (tmp_path / f"0000:{i:02x}:00.0").mkdir()
    return tmp_path


@pytest.mark.parametrize(("listed", "seen"), [
    (None, 4), ("", 0), ("-1", 0), ("1,3", 2), ("0,1,2,3,4,5", 4), ("2,-1,3", 1), ("GPU-8f2c,MIG-1a", 2), ("7", 0),
])
def test_visible_gpus_are_the_drivers_narrowed_as_cuda_visible_devices_narrows_them(
        tmp_path: Path, listed: str | None, seen: int) -> None:
    env = {} if listed is None else {"CUDA_VISIBLE_DEVICES": listed}
    assert visible_gpu_count(gpus(tmp_path, 4), env) == seen


def test_no_driver_means_no_gpu(tmp_path: Path) -> None:
    assert visible_gpu_count(tmp_path / "absent", {}) == 0
