"""The TorchScript backend, on small modules scripted and traced in the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from servewell.config.model import ModelConfig
from servewell.runtimes import ModelLoadError, load_runtime
from servewell.runtimes.warmup import warm_up

# torch 2.13 marks torch.jit (script, freeze, optimize) as deprecated and warns on each call.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class TwoHeads(torch.nn.Module):
    """Returns a tuple; an int input shows that only floating inputs follow the serving dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.table = torch.nn.Embedding(10, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.fc(x) + self.table(ids)
        return hidden, hidden.argmax(dim=1)


class NamedHeads(torch.nn.Module):
    """Returns a dict keyed by output name."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": self.fc(x), "norm": x.abs().sum(dim=1, keepdim=True)}


def make_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "name": "twoheads",
        "runtime": "torchscript",
        "artifact": "model.pt",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}, {"name": "ids", "datatype": "INT64", "shape": []}],
        "outputs": [
            {"name": "hidden", "datatype": "FP32", "shape": [3]},
            {"name": "best", "datatype": "INT32", "shape": []},
        ],
        "max_batch_size": 4,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((3, 4), dtype=np.float32), "ids": np.array([1, 5, 9], dtype=np.int64)}


def reference(module: torch.nn.Module, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        result = module(torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["ids"]))
    return [t.numpy() for t in result]


@pytest.mark.parametrize(
    ("freeze", "optimize"), [(False, False), (True, False), (False, True)], ids=["plain", "freeze", "optimize"]
)
def test_scripted_tuple_output_matches_eager(tmp_path: Path, freeze: bool, optimize: bool) -> None:
    module = TwoHeads().eval()
    torch.jit.save(torch.jit.script(module), str(tmp_path / "model.pt"))
    config = make_config(torchscript={"freeze": freeze, "optimize_for_inference": optimize})
    stages: list[str] = []
    runtime = load_runtime(config, tmp_path, stages.append)

    outputs = runtime.run(batch())

    hidden, best = reference(module, batch())
    np.testing.assert_allclose(outputs["hidden"], hidden, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outputs["best"], best)
    assert outputs["best"].dtype == np.int32
    assert ("freeze" in stages) == (freeze or optimize)
    warm_up(runtime, config)
    runtime.close()


def test_bf16_serving_gives_float32_close_to_eager(tmp_path: Path) -> None:
    # Scripted rather than traced: the runtime treats both alike, and the first trace in a
    # process costs most of a second.
    module = TwoHeads().eval()
    example = batch()
    torch.jit.save(torch.jit.script(module), str(tmp_path / "model.pt"))
    stages: list[str] = []
    runtime = load_runtime(make_config(torchscript={"dtype": "bf16"}), tmp_path, stages.append)

    outputs = runtime.run(example)

    assert outputs["hidden"].dtype == np.float32
    np.testing.assert_allclose(outputs["hidden"], reference(module, example)[0], rtol=5e-2, atol=5e-2)
    assert "convert to bf16" in stages


def test_dict_output_is_mapped_by_name(tmp_path: Path) -> None:
    module = NamedHeads().eval()
    torch.jit.save(torch.jit.script(module), str(tmp_path / "model.pt"))
    config = make_config(
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
        outputs=[
            {"name": "norm", "datatype": "FP32", "shape": [1]},
            {"name": "scores", "datatype": "FP32", "shape": [3]},
        ],
    )
    x = batch()["x"]
    outputs = load_runtime(config, tmp_path, lambda stage: None).run({"x": x})
    with torch.no_grad():
        expected = module(torch.from_numpy(x))
    np.testing.assert_allclose(outputs["scores"], expected["scores"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["norm"], expected["norm"].numpy(), rtol=1e-5)


def test_declared_output_missing_from_dict_fails_warm_up(tmp_path: Path) -> None:
    torch.jit.save(torch.jit.script(NamedHeads()), str(tmp_path / "model.pt"))
    config = make_config(
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [3]}],
    )
    runtime = load_runtime(config, tmp_path, lambda stage: None)
    with pytest.raises(ModelLoadError, match=r"missing outputs \['logits'\]"):
        warm_up(runtime, config)


def test_a_state_dict_is_not_a_torchscript_archive(tmp_path: Path) -> None:
    torch.save(TwoHeads().state_dict(), tmp_path / "model.pt")
    with pytest.raises(ModelLoadError, match="runtime: pytorch"):
        load_runtime(make_config(), tmp_path, lambda stage: None)
