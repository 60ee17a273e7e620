"""Tiny model directories for deployment tests: y = 2x, as ONNX (quick to load) or as PyTorch.

The PyTorch factory sleeps for the seconds written in `load_delay_s` beside it (if that file
exists) before building the module: a stand-in for a model that takes a while to load. Both kinds
have the same name, inputs and outputs, so one can replace the other in a repository. Written
without importing torch (weights through safetensors' numpy API, the graph with onnx.helper).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper
from safetensors.numpy import save_file

FACTORY = textwrap.dedent('''
    import time
    from pathlib import Path

    import torch
    from torch import nn


    class Scale(nn.Module):
        """y = x * scale (scale = 2 in the weights): cheap, and its answers can be checked."""

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.scale


    def build():
        delay = Path(__file__).with_name("load_delay_s")
        if delay.is_file():
            time.sleep(float(delay.read_text()))
        return Scale()
''')

#: OIP body of one request with x = 3 (the answer is 6).
INFER_BODY = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [3.0]}]}


def write_tiny_model(root: Path, name: str = "tiny", runtime: str = "onnx", load_delay_s: float | None = None) -> Path:
    """Write `root/name` (one instance, one thread, max batch 8); returns the model directory.

    runtime "onnx": loads in well under a second; "pytorch": honours `load_delay_s` (see module doc).
    """
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        stale.unlink()
    config = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        "max_batch_size": 8, "instances": 1, "threads": 1,
    }
    if runtime == "onnx":
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "scale"], ["y"])], "tiny",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
            [helper.make_tensor("scale", TensorProto.FLOAT, [1], [2.0])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.save(model, str(directory / "model.onnx"))
        config.update(runtime="onnx", artifact="model.onnx")
    else:
        (directory / "tiny_factory.py").write_text(FACTORY)
        save_file({"scale": np.full(1, 2.0, dtype=np.float32)}, str(directory / "model.safetensors"))
        # The factory reads load_delay_s beside it: snapshots copy only the files a model uses, so it
        # is listed (a glob, since the file is there only while a delay is set).
        config.update(runtime="pytorch", artifact="model.safetensors", pytorch={"factory": "tiny_factory:build"},
                      extra_files=["load_delay_s*"])
        set_load_delay(directory, load_delay_s)
    (directory / "model.yaml").write_text(yaml.safe_dump(config))
    return directory


def set_load_delay(model_dir: Path, seconds: float | None) -> None:
    """Make the next loads of the model take `seconds` longer (None: no delay)."""
    path = model_dir / "load_delay_s"
    if seconds is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(f"{seconds:g}")
