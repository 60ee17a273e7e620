"""The onnxruntime backend, on small graphs exported from torch in the test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from servewell.config.model import ModelConfig
from servewell.cpu_limit import machine_cpus
from servewell.runtimes import ModelLoadError, load_runtime
from servewell.runtimes.onnx_runtime import cuda_provider_options, spin_wait
from servewell.runtimes.warmup import warm_up

# The legacy (TorchScript-based) exporter is the one that works without onnxscript; it warns
# that it is deprecated on every export.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class AddScaled(torch.nn.Module):
    """Two inputs, two outputs: shows that inputs are fed by name and outputs picked by name."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.fc(a * 2.0 + b)
        return torch.relu(hidden), hidden.sum(dim=1, keepdim=True)


def export(model_dir: Path, *, dynamic_batch: bool = True) -> AddScaled:
    module = AddScaled().eval()
    axes = {name: {0: "batch"} for name in ("a", "b", "y", "total")} if dynamic_batch else None
    torch.onnx.export(
        module,
        (torch.zeros(2, 4), torch.zeros(2, 4)),
        str(model_dir / "model.onnx"),
        input_names=["a", "b"],
        output_names=["y", "total"],
        dynamic_axes=axes,
        dynamo=False,
    )
    return module


def make_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "name": "addscaled",
        "runtime": "onnx",
        "artifact": "model.onnx",
        # Declared in the opposite order of the graph's inputs on purpose.
        "inputs": [{"name": "b", "datatype": "FP32", "shape": [4]}, {"name": "a", "datatype": "FP32", "shape": [4]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [3]},
            {"name": "total", "datatype": "FP64", "shape": [1]},
        ],
        "max_batch_size": 8,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, AddScaled]:
    model_dir = tmp_path_factory.mktemp("onnx")
    return model_dir, export(model_dir)


def test_outputs_match_torch_by_name_and_in_declared_dtypes(exported: tuple[Path, AddScaled]) -> None:
    model_dir, module = exported
    stages: list[str] = []
    runtime = load_runtime(make_config(), model_dir, stages.append)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 4), dtype=np.float32), rng.standard_normal((5, 4), dtype=np.float32)

    outputs = runtime.run({"a": a, "b": b})

    expected_y, expected_total = (t.detach().numpy() for t in module(torch.from_numpy(a), torch.from_numpy(b)))
    np.testing.assert_allclose(outputs["y"], expected_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["total"], expected_total, rtol=1e-5, atol=1e-6)
    assert outputs["total"].dtype == np.float64
    assert stages
    report = warm_up(runtime, make_config())
    assert report.seconds >= 0.0
    assert report.serving_dtype == "fp32"
    runtime.close()


def test_a_subset_of_outputs_may_be_declared(exported: tuple[Path, AddScaled]) -> None:
    model_dir, _ = exported
    config = make_config(outputs=[{"name": "total", "datatype": "FP32", "shape": [1]}])
    runtime = load_runtime(config, model_dir, lambda stage: None)
    outputs = runtime.run({"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)})
    assert list(outputs) == ["total"]


def test_mismatched_input_names_name_both_sides(exported: tuple[Path, AddScaled]) -> None:
    model_dir, _ = exported
    config = make_config(
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}, {"name": "a", "datatype": "FP32", "shape": [4]}]
    )
    with pytest.raises(ModelLoadError, match=r"model.yaml \['x', 'a'\].*graph's inputs \['a', 'b'\]"):
        load_runtime(config, model_dir, lambda stage: None)


def test_unknown_output_name_is_refused(exported: tuple[Path, AddScaled]) -> None:
    model_dir, _ = exported
    config = make_config(outputs=[{"name": "logits", "datatype": "FP32", "shape": [3]}])
    with pytest.raises(ModelLoadError, match=r"\['logits'\].*\['y', 'total'\]"):
        load_runtime(config, model_dir, lambda stage: None)


def test_wrong_declared_input_shape_is_refused(exported: tuple[Path, AddScaled]) -> None:
    model_dir, _ = exported
    config = make_config(
        inputs=[{"name": "a", "datatype": "FP32", "shape": [5]}, {"name": "b", "datatype": "FP32", "shape": [4]}]
    )
    with pytest.raises(ModelLoadError, match="input 'a': dimension 1 is 4"):
        load_runtime(config, model_dir, lambda stage: None)


def test_missing_batch_dimension_is_explained(exported: tuple[Path, AddScaled]) -> None:
    model_dir, _ = exported
    with pytest.raises(ModelLoadError, match="max_batch_size"):
        load_runtime(make_config(max_batch_size=0), model_dir, lambda stage: None)


def test_graph_with_fixed_batch_is_refused_for_dynamic_batching(tmp_path: Path) -> None:
    export(tmp_path, dynamic_batch=False)
    with pytest.raises(ModelLoadError, match="fixes the batch dimension to 2"):
        load_runtime(make_config(), tmp_path, lambda stage: None)


def test_warm_up_catches_a_wrong_declared_output_shape(exported: tuple[Path, AddScaled]) -> None:
    model_dir, _ = exported
    config = make_config(outputs=[{"name": "y", "datatype": "FP32", "shape": [5]}])
    runtime = load_runtime(config, model_dir, lambda stage: None)
    with pytest.raises(ModelLoadError, match=r"output 'y' has shape \[1, 3\]"):
        warm_up(runtime, config)


def test_corrupt_file_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not a graph")
    with pytest.raises(ModelLoadError, match="onnxruntime cannot load model.onnx"):
        load_runtime(make_config(), tmp_path, lambda stage: None)


def test_device_memory_limit_caps_the_cuda_providers_arena() -> None:
    assert cuda_provider_options("cuda:1", 2 << 30) == {"device_id": "1", "gpu_mem_limit": str(2 << 30)}
    assert cuda_provider_options("cuda", None) == {"device_id": "0"}


@pytest.mark.parametrize(("instances", "threads", "cpus", "spins"), [
    (1, 2, 64, True),  # a core stays free
    (1, 2, 3, True),
    (1, 3, 3, False),  # a container limited to 3 CPUs on a 64-core node: spinning would spend its quota
    (2, 2, 3, False),
])
def test_intra_op_threads_spin_only_when_a_core_of_the_machine_or_its_cpu_limit_stays_free(
        instances: int, threads: int, cpus: int, spins: bool):
    assert spin_wait(make_config(instances=instances, threads=threads), cpus) is spins
    # What model.yaml says wins either way.
    assert spin_wait(make_config(instances=instances, threads=threads, onnx={"spin_wait": not spins}), cpus) is (
        not spins)


def test_the_machines_cpus_count_a_containers_cpu_limit(tmp_path: Path):
    (tmp_path / "cgroup" / "ctr").mkdir(parents=True)
    (tmp_path / "cgroup" / "cgroup.controllers").write_text("cpu\n")
    (tmp_path / "cgroup" / "ctr" / "cpu.max").write_text("200000 100000\n")
    (tmp_path / "cgroup-of-self").write_text("0::/ctr\n")
    assert machine_cpus(tmp_path / "cgroup", tmp_path / "cgroup-of-self") == min(2, os.cpu_count() or 1)
    assert machine_cpus(tmp_path / "none", tmp_path / "no-file") == (os.cpu_count() or 1)
