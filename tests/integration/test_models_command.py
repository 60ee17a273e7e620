"""`servewell models` as a user runs it: a child process builds pytorch factories; the exit code says it all."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from servewell.engine.memory_budget import RUNTIME_BASE_BYTES

FACTORY = textwrap.dedent('''
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
''')
TENSORS = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
           "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}


def pytorch_model(root: Path, name: str, lazy: list[str]) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / f"{name}_factory.py").write_text(FACTORY)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors",
        "pytorch": {"factory": f"{name}_factory:build", "lazy_submodules": lazy}, **TENSORS,
    }))


def onnx_model(root: Path, name: str) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "model.onnx").write_bytes(b"\0" * 1000)  # the estimate reads the size only
    (directory / "model.yaml").write_text(yaml.safe_dump({"runtime": "onnx", "artifact": "model.onnx", **TENSORS}))


def models(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servewell", "models", "--model-repository", str(root), *flags],
                          capture_output=True, text=True, timeout=180, check=False)


def test_a_repository_the_server_would_serve_whole_exits_0(tmp_path: Path) -> None:
    pytorch_model(tmp_path, "lazy_ok", ["2"])  # Sequential's children are named by number
    onnx_model(tmp_path, "tiny")
    done = models(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    heads = [line.split()[:2] for line in done.stdout.splitlines()[1:] if not line.startswith(" " * 4)]
    assert heads == [["lazy_ok", "ok"], ["tiny", "ok"]]


def test_a_missing_lazy_submodule_and_a_refusal_by_the_budget_exit_1(tmp_path: Path) -> None:
    pytorch_model(tmp_path, "a_lazy", ["2", "decoder"])
    onnx_model(tmp_path, "b_tiny")
    onnx_model(tmp_path, "c_tiny")
    # Room for the pytorch model and one onnx model: the second onnx model is refused.
    budget = RUNTIME_BASE_BYTES["pytorch"] + RUNTIME_BASE_BYTES["onnx"] + (2 << 20)
    done = models(tmp_path, "--memory-budget-bytes", str(budget))
    assert done.returncode == 1
    assert "field 'pytorch.lazy_submodules': lazy_submodules ['decoder'] are not submodules of the model" in done.stdout
    refused = [line for line in done.stdout.splitlines() if line.startswith("  c_tiny")]
    assert len(refused) == 1 and "REFUSED  would be refused: needs 120 MiB" in refused[0], done.stdout
