"""Small models written into a model repository by the tests that serve them, and the body of an
OIP request for their one-row input `x`.

They are stand-ins with known behaviour (a fixed delay per batch, a leak, a fault), built in the
test in seconds: no download, nothing shared between test modules but this code.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

#: One FP32 value in, the same value out.
SCALAR_IO = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
}

SLOW_FACTORY = textwrap.dedent('''
    import time

    import torch
    from torch import nn


    class Slow(nn.Module):
        """Echoes its input after a fixed delay per batch: a stand-in for a heavy model."""

        def __init__(self, delay_ms: float = 100.0):
            super().__init__()
            self.delay_s = delay_ms / 1000.0
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            time.sleep(self.delay_s)
            return x * self.scale


    def build(delay_ms: float = 100.0):
        return Slow(delay_ms)
''')


def infer_body(value: float, **parameters: Any) -> dict[str, Any]:
    """An OIP request with one row `[value]` for input `x` (`parameters`: OIP request parameters)."""
    doc: dict[str, Any] = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    if parameters:
        doc["parameters"] = parameters
    return doc


def slow_model(root: Path, name: str, delay_ms: float, **fields: Any) -> None:
    """A PyTorch model that echoes `x` after `delay_ms` per batch; `fields` go to its model.yaml."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "slow_factory.py").write_text(SLOW_FACTORY)
    save_file({"scale": torch.ones(1)}, str(directory / "model.safetensors"))
    config = {
        "runtime": "pytorch", "artifact": "model.safetensors",
        "pytorch": {"factory": "slow_factory:build", "factory_kwargs": {"delay_ms": delay_ms}}, **SCALAR_IO, **fields,
    }
    (directory / "model.yaml").write_text(yaml.safe_dump(config))


def factory_model(root: Path, name: str, source: str, **fields: Any) -> None:
    """A PyTorch model built by `source`'s `build()`; its weights are `scale` when the source
    mentions one, else those of `nn.Linear(1, 1)`."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "factory.py").write_text(source)
    weights = {"scale": torch.ones(1)} if "scale" in source else {"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors", **SCALAR_IO,
        "pytorch": {"factory": "factory:build", **fields.pop("pytorch", {})}, **fields,
    }))


def onnx_linear_model(root: Path, name: str, version: str = "1") -> None:
    """A seeded `nn.Linear(1, 1)` exported to ONNX, served by onnxruntime (replaces an older version)."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.onnx.export(torch.nn.Linear(1, 1), (torch.zeros(2, 1),), str(directory / "model.onnx"), dynamo=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "version": version, "max_batch_size": 8, **SCALAR_IO,
    }))


def onnx_mlp_model(root: Path, name: str, **fields: Any) -> Path:
    """`nn.Linear(4, 3)` exported to ONNX with a dynamic batch axis (input `x` [4], output `y` [3]);
    `fields` replace model.yaml's (inputs, outputs, max_batch_size...). Returns the directory."""
    directory = root / name
    directory.mkdir(parents=True)
    torch.manual_seed(0)
    torch.onnx.export(torch.nn.Linear(4, 3), (torch.zeros(2, 4),), str(directory / "model.onnx"), dynamo=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}], **fields,
    }))
    return directory


def torchscript_mlp_model(root: Path, name: str, **fields: Any) -> Path:
    """`nn.Linear(4, 3)` traced to TorchScript (input `x` [4], output `y` [3]); `fields` replace
    model.yaml's. Returns the directory."""
    directory = root / name
    directory.mkdir(parents=True)
    torch.manual_seed(0)
    torch.jit.trace(torch.nn.Linear(4, 3), torch.zeros(2, 4)).save(str(directory / "model.pt"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "torchscript", "artifact": "model.pt", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}], **fields,
    }))
    return directory
