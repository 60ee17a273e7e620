"""The model repository of `bench.chaos` (imports torch: run it as a process).

    python -m bench.chaos_models --work bench/results/work/chaos

Writes, under the work directory:

* `build/digits/`, `build/resnet50/`: servewell's example models (ONNX), built once and cached by
  `servewell.examples.build`.
* `flaky/`: a PyTorch model that raises on any negative input (a model with a bug on some inputs).
* `leaky/`: a PyTorch model that keeps 16 MiB more host memory on every batch (a leak), with
  `host_memory_limit_bytes` 1 GiB and no warm-up.
* `hanging/`: a PyTorch model whose factory sleeps for ten minutes (a load that never finishes);
  it is copied into the served repository only when the chaos suite asks the server to load it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

#: One FP32 value in, one out.
SCALAR_IO: dict[str, Any] = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
}

FLAKY = textwrap.dedent('''
    import torch
    from torch import nn


    class Flaky(nn.Module):
        """Scales its input, and raises on a negative one: a model with a bug on some inputs."""

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            if bool((x < 0).any()):
                raise ValueError("negative input")
            return x * self.scale


    def build():
        return Flaky()
''')

LEAKY = textwrap.dedent('''
    import torch
    from torch import nn


    class Leaky(nn.Module):
        """Scales its input and keeps `leak_mib` MiB of written memory per batch: a slow leak."""

        def __init__(self, leak_mib: int = 16):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.kept = []
            self.floats = leak_mib * 2**20 // 4

        def forward(self, x):
            self.kept.append(torch.ones(self.floats))  # ones() writes every page: resident memory
            return x * self.scale


    def build(leak_mib: int = 16):
        return Leaky(leak_mib)
''')

HANGING = textwrap.dedent('''
    import time

    from torch import nn


    def build():
        time.sleep(600)  # a load that never finishes (a stuck download, a deadlock)
        return nn.Linear(1, 1)
''')


def factory_model(directory: Path, source: str, **fields: Any) -> None:
    """A PyTorch model built by `source`'s `build()` with one weight `scale` (or nn.Linear's)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "factory.py").write_text(source)
    weights = {"scale": torch.ones(1)} if "scale" in source else {"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}
    save_file(weights, str(directory / "model.safetensors"))
    pytorch = {"factory": "factory:build", **fields.pop("pytorch", {})}
    config = {"runtime": "pytorch", "artifact": "model.safetensors", **SCALAR_IO, "pytorch": pytorch, **fields}
    (directory / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def build_all(work: Path) -> None:
    """Everything the chaos suite serves, under `work`."""
    for example in ("digits", "resnet50"):
        command = [sys.executable, "-m", "servewell.examples.build", example, "--out", str(work / "build"),
                   "--runtime", "onnx"]
        subprocess.run(command, check=True, timeout=900)
    factory_model(work / "flaky", FLAKY, max_batch_size=8)
    factory_model(work / "leaky", LEAKY, max_batch_size=4, warmup=False, host_memory_limit_bytes=2**30,
                  pytorch={"factory_kwargs": {"leak_mib": 16}})
    factory_model(work / "hanging", HANGING, max_batch_size=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    build_all(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
