"""Dummy batches and the warm-up check, against small fake runtimes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from servewell.config.model import ModelConfig
from servewell.runtimes import ModelLoadError
from servewell.runtimes.warmup import dummy_batch, warm_up

Outputs = dict[str, np.ndarray]


class FakeRuntime:
    """Answers each batch with `answer(inputs)` and records the batch sizes it saw."""

    def __init__(self, answer: Callable[[Outputs], Outputs]) -> None:
        self.answer = answer
        self.batch_sizes: list[int] = []

    def run(self, inputs: Outputs) -> Outputs:
        self.batch_sizes.append(len(next(iter(inputs.values()))))
        return self.answer(inputs)

    def close(self) -> None:
        pass


def make_config(
    max_batch_size: int = 4, output_shape: list[int] | None = None, inputs: list[dict[str, Any]] | None = None
) -> ModelConfig:
    return ModelConfig(
        name="fake",
        runtime="onnx",
        artifact="model.onnx",
        inputs=inputs
        or [
            {"name": "x", "datatype": "FP32", "shape": [-1, 3]},
            {"name": "ids", "datatype": "INT64", "shape": [2]},
        ],
        outputs=[{"name": "y", "datatype": "FP32", "shape": output_shape or [-1, 5]}],
        max_batch_size=max_batch_size,
    )


def answer_y(shape_after_batch: tuple[int, ...], dtype: str = "float32") -> Callable[[Outputs], Outputs]:
    return lambda inputs: {"y": np.zeros((len(inputs["x"]), *shape_after_batch), dtype=dtype)}


def test_dummy_batch_has_batch_dim_declared_dtypes_and_variable_dims_of_one() -> None:
    batch = dummy_batch(make_config(), 3)
    assert batch["x"].shape == (3, 1, 3) and batch["x"].dtype == np.float32
    assert batch["ids"].shape == (3, 2) and batch["ids"].dtype == np.int64
    assert not batch["x"].any()


def test_dummy_batch_without_batch_dim() -> None:
    batch = dummy_batch(make_config(max_batch_size=0), 8)
    assert batch["x"].shape == (1, 3)
    assert batch["ids"].shape == (2,)


def test_dummy_batch_bytes_input() -> None:
    config = make_config(inputs=[{"name": "s", "datatype": "BYTES", "shape": [1]}])
    batch = dummy_batch(config, 2)
    assert batch["s"].dtype == object and batch["s"].shape == (2, 1)


def test_warm_up_runs_one_and_max_batch_and_returns_seconds() -> None:
    runtime = FakeRuntime(answer_y((7, 5)))
    seconds = warm_up(runtime, make_config(max_batch_size=4))
    assert runtime.batch_sizes == [1, 4]
    assert seconds >= 0.0


def test_warm_up_with_max_batch_one_runs_once() -> None:
    runtime = FakeRuntime(answer_y((1, 5)))
    warm_up(runtime, make_config(max_batch_size=1))
    assert runtime.batch_sizes == [1]


def test_warm_up_rejects_wrong_fixed_dimension() -> None:
    with pytest.raises(ModelLoadError, match=r"output 'y' has shape \[1, 1, 6\]"):
        warm_up(FakeRuntime(answer_y((1, 6))), make_config())


def test_warm_up_rejects_wrong_rank() -> None:
    with pytest.raises(ModelLoadError, match="output 'y'"):
        warm_up(FakeRuntime(answer_y((5,))), make_config())


def test_warm_up_rejects_output_that_is_not_per_item() -> None:
    runtime = FakeRuntime(lambda inputs: {"y": np.zeros((1, 1, 5), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="a batch of 4"):
        warm_up(runtime, make_config(max_batch_size=4))


def test_warm_up_rejects_missing_output_and_names_the_present_ones() -> None:
    runtime = FakeRuntime(lambda inputs: {"logits": np.zeros((1, 1, 5), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match=r"no output 'y'.*\['logits'\]"):
        warm_up(runtime, make_config())


def test_warm_up_rejects_wrong_dtype() -> None:
    with pytest.raises(ModelLoadError, match="dtype float64"):
        warm_up(FakeRuntime(answer_y((1, 5), dtype="float64")), make_config())


def test_warm_up_wraps_a_failing_model() -> None:
    def fail(inputs: Outputs) -> Outputs:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(ModelLoadError, match="warm-up batch of 1 failed: mat1"):
        warm_up(FakeRuntime(fail), make_config())


def test_warm_up_without_batch_dim_checks_the_item_shape() -> None:
    runtime = FakeRuntime(lambda inputs: {"y": np.zeros((2, 5), dtype=np.float32)})
    warm_up(runtime, make_config(max_batch_size=0))
