"""The PyTorch backend: a factory module shipped in the model directory plus a weights file."""

from __future__ import annotations

import importlib.util
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from servewell.config.model import ModelConfig
from servewell.runtimes import ModelLoadError, load_runtime
from servewell.runtimes.pytorch_runtime import build_module, build_on_meta
from servewell.runtimes.torch_execution import TorchModuleRuntime, cpu_has_native_bf16
from servewell.runtimes.warmup import warm_up

FACTORY_SOURCE = '''
import torch
from torch import nn

#: Device of the first weight at the moment the factory returned; the test reads it back.
BUILT_ON: list[str] = []


class Net(nn.Module):
    def __init__(self, hidden: int, extra_buffer: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))
        if extra_buffer:
            self.register_buffer("offset", torch.ones(3), persistent=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def build(hidden: int = 8, extra_buffer: bool = False) -> Net:
    net = Net(hidden, extra_buffer)
    BUILT_ON.append(str(net.fc1.weight.device))
    return net
'''


class ModelDir:
    """A model directory holding a factory module under a name unique to the test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.module_name = f"toy_net_{uuid.uuid4().hex[:12]}"
        (path / f"{self.module_name}.py").write_text(FACTORY_SOURCE)
        spec = importlib.util.spec_from_file_location(self.module_name, path / f"{self.module_name}.py")
        assert spec is not None and spec.loader is not None
        self.module: ModuleType = importlib.util.module_from_spec(spec)
        # Registered so that torch.save can pickle a whole Net by its module name.
        sys.modules[self.module_name] = self.module
        spec.loader.exec_module(self.module)

    def reference(self, hidden: int = 8) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.module.build(hidden=hidden).eval()

    def config(self, artifact: str, **settings: Any) -> ModelConfig:
        """A config for `artifact`; `settings` change fields of its `pytorch:` section."""
        return ModelConfig.model_validate({
            "name": "toy",
            "runtime": "pytorch",
            "artifact": artifact,
            "pytorch": {"factory": f"{self.module_name}:build", "factory_kwargs": {"hidden": 8}, **settings},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
            "max_batch_size": 4,
        })


@pytest.fixture
def model_dir(tmp_path: Path) -> Iterator[ModelDir]:
    saved_path = list(sys.path)
    made = ModelDir(tmp_path)
    yield made
    # The runtime puts the model directory on sys.path, as a worker process should; a test
    # process loads many, so undo it.
    sys.path[:] = saved_path
    sys.modules.pop(made.module_name, None)


def x_batch() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((3, 4), dtype=np.float32)


def expected(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def test_safetensors_weights_load_on_meta_first_and_match_eager(model_dir: ModelDir) -> None:
    reference = model_dir.reference()
    save_file(reference.state_dict(), str(model_dir.path / "model.safetensors"))
    model_dir.module.BUILT_ON.clear()
    stages: list[str] = []
    config = model_dir.config("model.safetensors")

    runtime = load_runtime(config, model_dir.path, stages.append)

    assert model_dir.module.BUILT_ON == ["meta"]
    np.testing.assert_allclose(runtime.run({"x": x_batch()})["y"], expected(reference, x_batch()), rtol=1e-6)
    assert stages.index("map weights") < stages.index("build graph on meta device") < stages.index("assign weights")
    warm_up(runtime, config)
    runtime.close()


def test_state_dict_pt_with_factory_kwargs(model_dir: ModelDir) -> None:
    reference = model_dir.reference(hidden=16)
    torch.save(reference.state_dict(), model_dir.path / "weights.pt")
    config = model_dir.config("weights.pt", factory_kwargs={"hidden": 16})
    runtime = load_runtime(config, model_dir.path, lambda stage: None)
    np.testing.assert_allclose(runtime.run({"x": x_batch()})["y"], expected(reference, x_batch()), rtol=1e-6)


def test_bf16_serving_returns_float32_close_to_fp32(model_dir: ModelDir) -> None:
    reference = model_dir.reference()
    save_file(reference.state_dict(), str(model_dir.path / "model.safetensors"))
    stages: list[str] = []
    runtime = load_runtime(model_dir.config("model.safetensors", dtype="bf16"), model_dir.path, stages.append)

    y = runtime.run({"x": x_batch()})["y"]

    assert y.dtype == np.float32
    np.testing.assert_allclose(y, expected(reference, x_batch()), rtol=5e-2, atol=5e-2)
    assert "convert to bf16" in stages


def test_missing_and_unexpected_keys_are_listed(model_dir: ModelDir) -> None:
    state = model_dir.reference().state_dict()
    del state["fc2.bias"]
    state["head.weight"] = torch.zeros(2)
    save_file(state, str(model_dir.path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing from the file: fc2\.bias; not in the module: head\.weight"):
        load_runtime(model_dir.config("model.safetensors"), model_dir.path, lambda stage: None)


def test_wrong_shapes_are_a_load_error(model_dir: ModelDir) -> None:
    save_file(model_dir.reference(hidden=16).state_dict(), str(model_dir.path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="do not fit the module"):
        load_runtime(model_dir.config("model.safetensors"), model_dir.path, lambda stage: None)


def test_non_persistent_buffer_left_on_meta_is_named(model_dir: ModelDir) -> None:
    save_file(model_dir.reference().state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", factory_kwargs={"hidden": 8, "extra_buffer": True})
    with pytest.raises(ModelLoadError, match="offset.*persistent=True"):
        load_runtime(config, model_dir.path, lambda stage: None)


def test_pickled_module_is_refused_by_default(model_dir: ModelDir) -> None:
    torch.save(model_dir.reference(), model_dir.path / "model.pt")
    with pytest.raises(ModelLoadError, match="runs arbitrary code.*unsafe_allow_pickle: true"):
        load_runtime(model_dir.config("model.pt"), model_dir.path, lambda stage: None)


def test_pickled_module_is_used_when_allowed(model_dir: ModelDir) -> None:
    reference = model_dir.reference()
    torch.save(reference, model_dir.path / "model.pt")
    model_dir.module.BUILT_ON.clear()
    stages: list[str] = []
    config = model_dir.config("model.pt", unsafe_allow_pickle=True)

    runtime = load_runtime(config, model_dir.path, stages.append)

    np.testing.assert_allclose(runtime.run({"x": x_batch()})["y"], expected(reference, x_batch()), rtol=1e-6)
    assert model_dir.module.BUILT_ON == []
    assert any("pickled module" in stage for stage in stages)


def test_factory_that_does_not_import_is_a_load_error(model_dir: ModelDir) -> None:
    save_file(model_dir.reference().state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", factory="no_such_module_here:build")
    with pytest.raises(ModelLoadError, match="cannot import factory module 'no_such_module_here'"):
        load_runtime(config, model_dir.path, lambda stage: None)


def test_factory_attribute_missing_is_a_load_error(model_dir: ModelDir) -> None:
    save_file(model_dir.reference().state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", factory=f"{model_dir.module_name}:make")
    with pytest.raises(ModelLoadError, match="has no 'make'"):
        load_runtime(config, model_dir.path, lambda stage: None)


def test_training_checkpoint_is_not_a_state_dict(model_dir: ModelDir) -> None:
    torch.save({"model": model_dir.reference().state_dict(), "epoch": 3}, model_dir.path / "ckpt.pt")
    with pytest.raises(ModelLoadError, match="not a plain state dict: model, epoch"):
        load_runtime(model_dir.config("ckpt.pt"), model_dir.path, lambda stage: None)


def test_lazy_submodule_stays_on_meta_until_first_use(model_dir: ModelDir) -> None:
    reference = model_dir.reference()
    save_file(reference.state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", lazy_submodules=["fc2"])

    module = build_module(config, model_dir.path, torch.device("cpu"), torch.float32, lambda stage: None)
    assert module.get_parameter("fc2.weight").is_meta and not module.get_parameter("fc1.weight").is_meta
    runtime = TorchModuleRuntime(module, config, torch.device("cpu"), torch.float32)

    np.testing.assert_allclose(runtime.run({"x": x_batch()})["y"], expected(reference, x_batch()), rtol=1e-6)
    assert not module.get_parameter("fc2.weight").is_meta


def test_lazy_submodule_under_eight_concurrent_first_requests(model_dir: ModelDir) -> None:
    reference = model_dir.reference()
    save_file(reference.state_dict(), str(model_dir.path / "model.safetensors"))
    runtime = load_runtime(
        model_dir.config("model.safetensors", lazy_submodules=["fc2"], dtype="bf16"), model_dir.path, lambda s: None
    )
    start = threading.Barrier(8)
    outputs: list[np.ndarray] = []

    def request() -> None:
        start.wait()
        outputs.append(runtime.run({"x": x_batch()})["y"])

    threads = [threading.Thread(target=request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(outputs) == 8
    for y in outputs:
        np.testing.assert_allclose(y, expected(reference, x_batch()), rtol=5e-2, atol=5e-2)
        np.testing.assert_array_equal(y, outputs[0])


def test_unknown_lazy_submodule_is_a_load_error(model_dir: ModelDir) -> None:
    save_file(model_dir.reference().state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", lazy_submodules=["head"])
    with pytest.raises(ModelLoadError, match=r"\['head'\] are not submodules.*fc1, fc2"):
        load_runtime(config, model_dir.path, lambda stage: None)


def test_lazy_submodules_need_a_weights_file_not_a_pickled_module(model_dir: ModelDir) -> None:
    torch.save(model_dir.reference(), model_dir.path / "model.pt")
    config = model_dir.config("model.pt", unsafe_allow_pickle=True, lazy_submodules=["fc2"])
    with pytest.raises(ModelLoadError, match="lazy_submodules needs a weights file"):
        load_runtime(config, model_dir.path, lambda stage: None)


def test_warm_up_loads_lazy_submodules_and_reports(model_dir: ModelDir) -> None:
    reference = model_dir.reference()
    save_file(reference.state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", lazy_submodules=["fc2"])
    module = build_module(config, model_dir.path, torch.device("cpu"), torch.float32, lambda stage: None)

    report = warm_up(TorchModuleRuntime(module, config, torch.device("cpu"), torch.float32), config)

    assert not module.get_parameter("fc2.weight").is_meta
    assert report.effective_max_batch_size == 4 and report.serving_dtype == "fp32"
    assert [size for size, _ in report.peak_bytes_by_batch] == [1, 2, 4]


def test_fp32_rebuild_from_the_weights_file_takes_over_when_bf16_is_off(model_dir: ModelDir) -> None:
    """What `load` sets up for dtype auto on a CPU with native bf16, built by hand on any CPU."""
    reference = model_dir.reference()
    save_file(reference.state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", dtype="auto", dtype_tolerance=1e-12, lazy_submodules=["fc2"])
    cpu = torch.device("cpu")
    reduced = build_module(config, model_dir.path, cpu, torch.bfloat16, lambda stage: None)

    def rebuild() -> torch.nn.Module:
        return build_module(config, model_dir.path, cpu, torch.float32, lambda stage: None)

    runtime = TorchModuleRuntime(reduced, config, cpu, torch.bfloat16, fp32_reference=rebuild)

    report = warm_up(runtime, config)

    assert report.precision_check is not None and report.precision_check.fell_back_to_fp32
    assert report.serving_dtype == "fp32"
    np.testing.assert_allclose(runtime.run({"x": x_batch()})["y"], expected(reference, x_batch()), rtol=1e-6)


def test_dtype_auto_with_a_tiny_tolerance_ends_in_fp32_on_any_cpu(model_dir: ModelDir) -> None:
    save_file(model_dir.reference().state_dict(), str(model_dir.path / "model.safetensors"))
    config = model_dir.config("model.safetensors", dtype="auto", dtype_tolerance=1e-12)
    runtime = load_runtime(config, model_dir.path, lambda stage: None)

    report = warm_up(runtime, config)

    # Without native bf16, auto is fp32 from the start; with it, the check falls back.
    assert report.serving_dtype == "fp32"
    assert (report.precision_check is not None) == cpu_has_native_bf16()


def test_build_on_meta_skips_initialisers_on_meta_tensors_only() -> None:
    cpu_values: list[torch.Tensor] = []

    def factory() -> torch.nn.Module:
        cpu_values.append(torch.nn.init.ones_(torch.empty(2, device="cpu")))
        embedding = torch.nn.Embedding(10, 3)  # torch.nn.init.normal_ on a meta weight
        embedding.weight.normal_()
        return embedding

    module = build_on_meta(factory, {})

    assert module.weight.is_meta and module.weight.shape == (10, 3)
    assert cpu_values[0].tolist() == [1.0, 1.0]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_converted_weights_let_go_of_the_mapped_file(model_dir: ModelDir) -> None:
    """Integer buffers need no conversion; copied, they no longer pin the whole file in memory."""
    state = model_dir.reference().state_dict()
    state["steps"] = torch.tensor(7)  # a non-floating tensor, like BatchNorm's num_batches_tracked
    path = model_dir.path / "model.safetensors"
    save_file(state, str(path))
    source = FACTORY_SOURCE.replace(
        'self.register_buffer("scale"',
        'self.register_buffer("steps", torch.tensor(0))\n        self.register_buffer("scale"',
    )
    (model_dir.path / f"{model_dir.module_name}.py").write_text(source)
    sys.modules.pop(model_dir.module_name, None)

    fp32 = load_runtime(model_dir.config("model.safetensors"), model_dir.path, lambda stage: None)
    assert str(path) in Path("/proc/self/maps").read_text()  # fp32 serves from the mapping itself
    fp32.close()
    del fp32
    bf16 = load_runtime(model_dir.config("model.safetensors", dtype="bf16"), model_dir.path, lambda stage: None)

    assert str(path) not in Path("/proc/self/maps").read_text()
    bf16.close()
