"""`servewell models` on a pipeline, as a user runs it: it refuses what the server would refuse at load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from model_dirs import onnx_mlp_model


def test_an_output_wired_to_a_step_output_that_does_not_exist_exits_1_naming_it(tmp_path: Path) -> None:
    """Issue 45 W6: `y: m.nope` passed `servewell models` and loaded ready."""
    onnx_mlp_model(tmp_path, "tiny")
    (tmp_path / "chain").mkdir()
    (tmp_path / "chain" / "model.yaml").write_text(yaml.safe_dump({
        "kind": "pipeline", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
        "pipeline": {"steps": [{"name": "m", "model": "tiny", "inputs": {"x": "x"}}], "outputs": {"y": "m.nope"}},
    }))
    done = subprocess.run([sys.executable, "-m", "servewell", "models", "--model-repository", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "output 'y': step 'm' (model 'tiny') has no output 'nope'; its outputs are ['y']" in done.stdout
