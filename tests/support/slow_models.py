"""Model repositories for e2e tests: a pytorch model that echoes its input after a fixed delay per
batch, a stand-in for a heavy model whose speed the test controls."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

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


def slow_model(root: Path, name: str, delay_ms: float, **fields: Any) -> None:
    """Write model `name` into repository `root`: y = x after `delay_ms` per batch."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "slow_factory.py").write_text(SLOW_FACTORY)
    save_file({"scale": torch.ones(1)}, str(directory / "model.safetensors"))
    config = {
        "runtime": "pytorch", "artifact": "model.safetensors",
        "pytorch": {"factory": "slow_factory:build", "factory_kwargs": {"delay_ms": delay_ms}},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        **fields,
    }
    (directory / "model.yaml").write_text(yaml.safe_dump(config))
