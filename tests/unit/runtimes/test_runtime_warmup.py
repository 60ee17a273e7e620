"""Dummy batches, the warm-up check and its memory sweep, against small fake runtimes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

from servewell.config.model import ModelConfig
from servewell.runtimes import ModelLoadError
from servewell.runtimes.memory_probe import ProcessPeakMemory
from servewell.runtimes.warmup import dummy_batch, precision_probe_batch, warm_up, warm_up_batch_sizes

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


class ScriptedPeaks:
    """A peak-memory probe that reports `bytes_per_item` times the last batch the runtime saw."""

    def __init__(self, runtime: FakeRuntime, base: int, bytes_per_item: int,
                 measures: Literal["host", "device"] = "host") -> None:
        self.runtime, self.base, self.bytes_per_item = runtime, base, bytes_per_item
        self.measures = measures

    def reset(self) -> None:
        pass

    def peak_bytes(self) -> int:
        return self.base + self.bytes_per_item * self.runtime.batch_sizes[-1]


class ProbedRuntime(FakeRuntime):
    """A fake runtime that brings its own memory probe, as the torch runtimes do."""

    def __init__(self, answer: Callable[[Outputs], Outputs], base: int, bytes_per_item: int,
                 measures: Literal["host", "device"] = "host") -> None:
        super().__init__(answer)
        self.probe = ScriptedPeaks(self, base, bytes_per_item, measures)

    def peak_memory_probe(self) -> ScriptedPeaks:
        return self.probe


def make_config(
    max_batch_size: int = 4,
    output_shape: list[int] | None = None,
    inputs: list[dict[str, Any]] | None = None,
    **overrides: Any,
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
        **overrides,
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


def test_precision_probe_batch_fills_floating_inputs_only_and_is_the_same_each_time() -> None:
    batch = precision_probe_batch(make_config())
    assert batch["x"].shape == (1, 1, 3) and batch["x"].any()
    assert not batch["ids"].any()
    np.testing.assert_array_equal(batch["x"], precision_probe_batch(make_config())["x"])


@pytest.mark.parametrize(
    ("max_batch_size", "sizes"),
    [(0, [1]), (1, [1]), (2, [1, 2]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (16, [1, 2, 4, 8, 16])],
)
def test_warm_up_batch_sizes_double_up_to_the_max(max_batch_size: int, sizes: list[int]) -> None:
    assert warm_up_batch_sizes(max_batch_size) == sizes


def test_warm_up_runs_doubling_batches_and_reports_peaks() -> None:
    runtime = FakeRuntime(answer_y((7, 5)))
    report = warm_up(runtime, make_config(max_batch_size=6))
    assert runtime.batch_sizes == [1, 2, 4, 6]
    assert report.seconds >= 0.0
    assert report.effective_max_batch_size == 6
    assert [size for size, _ in report.peak_bytes_by_batch] == [1, 2, 4, 6]
    assert all(peak > 0 for _, peak in report.peak_bytes_by_batch)
    assert report.serving_dtype == "" and report.precision_check is None


def test_memory_limit_lowers_the_effective_max_batch_size_and_stops_the_sweep() -> None:
    runtime = ProbedRuntime(answer_y((1, 5)), base=1000, bytes_per_item=100)
    stages: list[str] = []
    report = warm_up(runtime, make_config(max_batch_size=16, host_memory_limit_bytes=1300), stages.append)
    assert runtime.batch_sizes == [1, 2, 4]
    assert report.effective_max_batch_size == 2
    assert report.peak_bytes_by_batch == ((1, 1100), (2, 1200), (4, 1400))
    assert any("over host_memory_limit_bytes" in stage for stage in stages)


def test_a_device_probe_is_held_against_the_device_limit_not_the_host_one() -> None:
    runtime = ProbedRuntime(answer_y((1, 5)), base=1000, bytes_per_item=100, measures="device")
    stages: list[str] = []
    config = make_config(max_batch_size=16, device="cuda", host_memory_limit_bytes=1050,
                         device_memory_limit_bytes=1300)
    report = warm_up(runtime, config, stages.append)
    assert report.effective_max_batch_size == 2  # the host limit (1050) would have refused batch 1
    assert any("over device_memory_limit_bytes" in stage for stage in stages)


def test_a_model_over_its_memory_limit_at_batch_one_fails_to_load_with_the_numbers() -> None:
    runtime = ProbedRuntime(answer_y((1, 5)), base=5 << 20, bytes_per_item=1 << 20)
    with pytest.raises(ModelLoadError, match=r"host_memory_limit_bytes at batch 1.*6291456 bytes.*4194304 bytes"):
        warm_up(runtime, make_config(host_memory_limit_bytes=4 << 20))


def test_memory_limit_without_batch_dimension_keeps_zero() -> None:
    runtime = ProbedRuntime(lambda inputs: {"y": np.zeros((2, 5), dtype=np.float32)}, base=10, bytes_per_item=1)
    report = warm_up(runtime, make_config(max_batch_size=0, host_memory_limit_bytes=100))
    assert report.effective_max_batch_size == 0
    assert report.peak_bytes_by_batch == ((1, 11),)


def test_real_resident_memory_of_a_model_whose_temporaries_grow_with_the_batch() -> None:
    """The process probe sees a temporary of 32 MiB per item and stops at the limit."""
    per_item = 32 << 20

    def allocate(inputs: Outputs) -> Outputs:
        rows = len(inputs["x"])
        temporary = np.ones(rows * per_item // 8)  # touched, so resident
        return {"y": np.full((rows, 1, 5), temporary[-1], dtype=np.float32)}

    probe = ProcessPeakMemory()
    probe.reset()
    resident = probe.peak_bytes()
    config = make_config(max_batch_size=8, host_memory_limit_bytes=resident + 3 * per_item)
    report = warm_up(FakeRuntime(allocate), config)
    assert report.effective_max_batch_size == 2
    peaks = dict(report.peak_bytes_by_batch)
    assert peaks[4] - peaks[1] >= 2 * per_item  # at least most of the 3 extra items' temporaries


def test_process_probe_falls_back_when_the_high_water_mark_cannot_be_reset(tmp_path: Path) -> None:
    (tmp_path / "clear_refs").mkdir()  # opening it for writing fails, as in a locked-down sandbox
    (tmp_path / "status").write_text("VmHWM:\t 9000 kB\nVmRSS:\t 1000 kB\n")
    probe = ProcessPeakMemory(tmp_path)
    probe.reset()
    assert not probe.exact
    assert probe.peak_bytes() >= 1000 * 1024


def test_warm_up_with_max_batch_one_runs_once() -> None:
    runtime = FakeRuntime(answer_y((1, 5)))
    assert warm_up(runtime, make_config(max_batch_size=1)).effective_max_batch_size == 1
    assert runtime.batch_sizes == [1]


def test_warm_up_rejects_wrong_fixed_dimension() -> None:
    with pytest.raises(ModelLoadError, match=r"output 'y' has shape \[1, 1, 6\]"):
        warm_up(FakeRuntime(answer_y((1, 6))), make_config())


def test_warm_up_rejects_wrong_rank() -> None:
    with pytest.raises(ModelLoadError, match="output 'y'"):
        warm_up(FakeRuntime(answer_y((5,))), make_config())


def test_warm_up_rejects_output_that_is_not_per_item() -> None:
    runtime = FakeRuntime(lambda inputs: {"y": np.zeros((1, 1, 5), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="a batch of 2"):
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


def test_a_first_only_warm_up_runs_batches_of_one_and_two_and_keeps_the_max() -> None:
    runtime = FakeRuntime(answer_y((7, 5)))
    report = warm_up(runtime, make_config(max_batch_size=32), first_only=True)
    assert runtime.batch_sizes == [1, 2]
    assert report.effective_max_batch_size == 32  # nothing limited it: batches up to 32 may form
    assert [size for size, _ in report.latency_by_batch] == [1, 2]


def test_a_first_only_warm_up_still_proves_a_host_memory_limit() -> None:
    runtime = ProbedRuntime(answer_y((7, 5)), base=1000, bytes_per_item=100)
    report = warm_up(runtime, make_config(max_batch_size=16, host_memory_limit_bytes=1300), first_only=True)
    assert runtime.batch_sizes == [1, 2, 4]  # 4 went over the limit: the sweep ran as without first_only
    assert report.effective_max_batch_size == 2


def test_a_first_only_warm_up_on_a_gpu_sweeps_every_size() -> None:
    runtime = ProbedRuntime(answer_y((7, 5)), base=0, bytes_per_item=1, measures="device")
    report = warm_up(runtime, make_config(max_batch_size=8), first_only=True)
    assert runtime.batch_sizes == [1, 2, 4, 8]  # a larger batch may run out of device memory
    assert report.effective_max_batch_size == 8
