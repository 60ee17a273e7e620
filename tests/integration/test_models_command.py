"""`servewell models` as a user runs it: a child process builds pytorch factories; the exit code says it all."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from model_dirs import onnx_mlp_model
from servewell.config.runtimes import runtime_descriptor

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
    onnx_mlp_model(root, name)


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
    budget = runtime_descriptor("pytorch").base_bytes + runtime_descriptor("onnx").base_bytes + (2 << 20)
    done = models(tmp_path, "--memory-budget-bytes", str(budget))
    assert done.returncode == 1
    assert "field 'pytorch.lazy_submodules': lazy_submodules ['decoder'] are not submodules of the model" in done.stdout
    refused = [line for line in done.stdout.splitlines() if line.startswith("  c_tiny")]
    assert len(refused) == 1 and "REFUSED  would be refused: needs 120 MiB" in refused[0], done.stdout


def model_block(stdout: str, name: str) -> str:
    """The lines `servewell models` prints for model `name`: its head line and the indented ones under it."""
    lines = stdout.splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 4)), len(lines))
    return "\n".join(lines[start:end])


def test_onnx_models_that_would_fail_at_load_or_warm_up_exit_1_naming_file_field_and_both_values(tmp_path: Path):
    scalar_out = [{"name": "y", "datatype": "FP32", "shape": [5]}]
    onnx_mlp_model(tmp_path, "a_ok")
    onnx_mlp_model(tmp_path, "b_input_name", inputs=[{"name": "input", "datatype": "FP32", "shape": [4]}])
    onnx_mlp_model(tmp_path, "c_output_shape", outputs=scalar_out)
    onnx_mlp_model(tmp_path, "d_input_shape", inputs=[{"name": "x", "datatype": "FP32", "shape": [3, 4]}])
    onnx_mlp_model(tmp_path, "e_output_name", outputs=[{"name": "logits", "datatype": "FP32", "shape": [3]}])
    onnx_mlp_model(tmp_path, "f_bytes", inputs=[{"name": "x", "datatype": "BYTES", "shape": [4]}])
    truncated = onnx_mlp_model(tmp_path, "g_truncated") / "model.onnx"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    done = models(tmp_path)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert model_block(out, "a_ok").split()[1] == "ok", out
    expected = {
        "b_input_name": "field 'inputs': names in model.yaml ['input'], the graph in model.onnx takes ['x']",
        "c_output_shape": "field 'outputs[0].shape': 'y': model.yaml declares a batch dimension plus [5], the graph "
                          "in model.onnx has shape ['b', 3] (dimension 1 differs)",
        "d_input_shape": "field 'inputs[0].shape': 'x': model.yaml declares a batch dimension plus [3, 4], the graph "
                         "in model.onnx has shape ['b', 4]; fix shape or max_batch_size",
        "e_output_name": "field 'outputs[0].name': 'logits' is not an output of the graph in model.onnx, which has "
                         "['y']",
        "f_bytes": "field 'inputs[0].datatype': 'x': model.yaml says BYTES, the graph in model.onnx has FP32",
        "g_truncated": "field 'artifact': onnxruntime cannot load model.onnx: ",
    }
    for name, message in expected.items():
        block = model_block(out, name)
        assert block.split()[1] == "INVALID" and f"{tmp_path / name / 'model.yaml'}:" in block, block
        assert message in " ".join(block.split()), block


def test_an_onnx_input_of_another_float_type_serves_and_gets_a_note(tmp_path: Path):
    onnx_mlp_model(tmp_path, "half", inputs=[{"name": "x", "datatype": "FP16", "shape": [4]}])
    done = models(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "inputs[0] 'x': model.yaml says FP16, the graph in model.onnx has FP32; converted on every request" \
        in done.stdout


def weights_model(root: Path, name: str, weights: dict[str, torch.Tensor], **factory_kwargs: int) -> Path:
    """A pytorch model whose factory builds `Linear(in_features, out_features)` from factory_kwargs."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / f"{name}_factory.py").write_text(textwrap.dedent('''
        import torch

        def build(in_features=4, out_features=3):
            return torch.nn.Linear(in_features, out_features)
    '''))
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors", **TENSORS,
        "pytorch": {"factory": f"{name}_factory:build", "factory_kwargs": factory_kwargs},
    }))
    return directory


def test_pytorch_weights_that_do_not_fit_the_factory_exit_1_naming_tensor_and_both_shapes(tmp_path: Path):
    linear = {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}
    weights_model(tmp_path, "a_ok", linear)
    weights_model(tmp_path, "b_kwargs", linear, out_features=10)
    weights_model(tmp_path, "c_missing", {"weight": torch.zeros(3, 4)})
    weights_model(tmp_path, "d_unexpected", {**linear, "extra.scale": torch.ones(1)})
    truncated = weights_model(tmp_path, "e_truncated", linear) / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-8])
    done = models(tmp_path)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert model_block(out, "a_ok").split()[1] == "ok", out
    expected = {
        "b_kwargs": "field 'pytorch.factory_kwargs': the module built with factory_kwargs {\"out_features\": 10} "
                    "does not fit the weights: weight is [10, 4] in the module, [3, 4] in model.safetensors; "
                    "bias is [10] in the module, [3] in model.safetensors",
        "c_missing": "field 'artifact': model.safetensors lacks 1 tensor(s) of the module the factory builds: bias",
        "d_unexpected": "field 'artifact': model.safetensors holds 1 tensor(s) the module the factory builds does "
                        "not have: extra.scale",
        "e_truncated": "field 'artifact': cannot read the weights file model.safetensors: ",
    }
    for name, message in expected.items():
        block = model_block(out, name)
        assert block.split()[1] == "INVALID" and f"{tmp_path / name / 'model.yaml'}:" in block, block
        assert message in " ".join(block.split()), block


def test_lazy_mode_serves_on_demand_what_one_budget_cannot_hold_at_once(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        onnx_model(tmp_path, name)
    budget = runtime_descriptor("onnx").base_bytes + (2 << 20)  # room for one model at a time
    eager = models(tmp_path, "--no-graph-check", "--memory-budget-bytes", str(budget))
    assert eager.returncode == 1 and [model_block(eager.stdout, n).split()[1] for n in "abc"] == \
        ["ok", "REFUSED", "REFUSED"], eager.stdout
    lazy = models(tmp_path, "--no-graph-check", "--memory-budget-bytes", str(budget), "--repository-mode", "lazy")
    assert lazy.returncode == 0, lazy.stdout + lazy.stderr
    assert [model_block(lazy.stdout, n).split()[1] for n in "abc"] == ["ok", "ok", "ok"], lazy.stdout
    assert "lazy mode: 0 pinned model(s) load at start (0 MiB), 3 load on their first request" in lazy.stdout
    assert "loads on demand" in model_block(lazy.stdout, "c")
    small = models(tmp_path, "--no-graph-check", "--memory-budget-bytes", str(budget // 2), "--repository-mode", "lazy")
    assert small.returncode == 1  # no model fits the whole budget: each is refused for good
    assert "more than the whole budget" in " ".join(model_block(small.stdout, "a").split()), small.stdout
