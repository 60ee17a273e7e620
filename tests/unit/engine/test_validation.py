"""A request's tensors checked against the model's declared inputs: names, dtypes, shapes and batch
sizes, each refusal naming the problem; the rules a config compiles to never outlive it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from servewell.config.model import ModelConfig
from servewell.engine.validation import check_inputs
from servewell.errors import InvalidInput


def config(width: int = 4, max_batch_size: int = 8, **extra: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": max_batch_size,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [width]},
                   {"name": "ids", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], **extra})


def good(rows: int = 2, width: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.zeros((rows, width), np.float32), "ids": np.zeros((rows, 5), np.int64)}


def test_a_fitting_request_gives_its_rows() -> None:
    assert check_inputs(config(), good(3)) == 3


@pytest.mark.parametrize(("inputs", "message"), [
    ({**good(), "z": np.zeros((2, 1), np.float32)}, "unknown input 'z'; model 'm' takes ['x', 'ids']"),
    ({"x": np.zeros((2, 4), np.float32)}, "missing input 'ids'"),
    ({"x": np.zeros((2, 4), np.float32), "z": np.zeros(1)}, "unknown input 'z'"),
    ({**good(), "x": np.zeros((2, 4), np.float64)}, "input 'x' has dtype float64, model 'm' expects FP32"),
    ({**good(), "x": np.zeros((2, 5), np.float32)}, "input 'x' has shape [2, 5], model 'm' expects [-1, 4]"),
    ({**good(), "x": np.zeros((0, 4), np.float32), "ids": np.zeros((0, 5), np.int64)}, "empty batch"),
    ({**good(), "ids": np.zeros((3, 5), np.int64)}, "all inputs must have the same batch size"),
    (good(9), "a batch of 9, above the model's max_batch_size 8"),
])
def test_each_misfit_is_refused_by_name(inputs: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_inputs(config(), inputs)
    assert message in refused.value.message


def test_a_reloaded_config_is_checked_against_its_own_inputs() -> None:
    before, after = config(width=4), config(width=6)
    assert check_inputs(before, good(2, 4)) == 2
    assert check_inputs(after, good(2, 6)) == 2  # the first config's rules do not apply to the second
    with pytest.raises(InvalidInput, match="expects \\[-1, 6\\]"):
        check_inputs(after, good(2, 4))


def test_a_model_without_batching_counts_one_request() -> None:
    unbatched = config(max_batch_size=0)
    assert check_inputs(unbatched, {"x": np.zeros(4, np.float32), "ids": np.zeros(7, np.int64)}) == 1
