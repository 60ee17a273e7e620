"""cpu_affinity: one list for every instance, or one list per instance, checked against instances."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servewell.config.model import ModelConfig
from servewell.config.problems import field_problems


def config(**changes: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "model.onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}], **changes,
    })


def problems(**changes: Any) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        config(**changes)
    return {p.field: p.reason for p in field_problems(caught.value)}


def test_one_list_per_instance_pins_each_instance_to_its_own_cpus() -> None:
    pinned = config(instances=2, cpu_affinity=[[0], [1, 2]])
    assert [pinned.affinity_of(0), pinned.affinity_of(1)] == [[0], [1, 2]]


def test_a_flat_list_applies_to_every_instance() -> None:
    shared = config(instances=3, cpu_affinity=[0, 1])
    assert [shared.affinity_of(i) for i in range(3)] == [[0, 1]] * 3


def test_no_affinity_lets_the_os_place_instances() -> None:
    assert config(instances=2).affinity_of(1) is None


def test_per_instance_lists_must_match_instances() -> None:
    found = problems(instances=2, cpu_affinity=[[0], [1], [2]])
    assert found == {"cpu_affinity": "has 3 per-instance lists; instances is 2, so give one list per instance "
                                     "(or one flat list for every instance)"}


def test_numbers_and_lists_cannot_mix() -> None:
    assert problems(cpu_affinity=[0, [1]])["cpu_affinity"].startswith("mixes numbers and lists")


@pytest.mark.parametrize(("affinity", "field", "reason"), [
    ([-1], "cpu_affinity.0", "-1 is not a CPU number (0, 1, ...)"),
    ([True], "cpu_affinity.0", "True is not a CPU number (0, 1, ...)"),
    ([0, 0], "cpu_affinity.1", "CPU 0 is listed twice"),
    ([[0], []], "cpu_affinity.1", "an instance needs at least one CPU"),
    ([["a"], [1]], "cpu_affinity.0.0", "'a' is not a CPU number (0, 1, ...)"),
])
def test_each_cpu_number_is_checked(affinity: list[Any], field: str, reason: str) -> None:
    assert problems(instances=2, cpu_affinity=affinity) == {field: reason}


def test_an_empty_list_is_refused_rather_than_meaning_anything() -> None:
    assert "leave cpu_affinity out" in problems(cpu_affinity=[])["cpu_affinity"]
