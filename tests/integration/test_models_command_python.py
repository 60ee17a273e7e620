"""`servewell models` on python models: a child process imports each entry class as the worker would
(not instantiating it); a missing class, an artifact that is not the entry's module and a BYTES
tensor are problems of their field; what the model's code prints does not garble the answer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

GOOD = '''
print("importing the model prints this")


class Model:
    def execute(self, inputs):
        return {"y": inputs["x"]}
'''


def python_model(root: Path, name: str, source: str, entry: str = "steps:Model", artifact: str = "steps.py",
                 **fields: Any) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / artifact).write_text(source)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": artifact, "python": {"entry": entry},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}], **fields,
    }))


def models(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servewell", "models", "--model-repository", str(root), *flags],
                          capture_output=True, text=True, timeout=180, check=False)


def test_python_entries_are_imported_and_each_problem_named_by_field(tmp_path: Path) -> None:
    python_model(tmp_path, "a_good", GOOD)
    python_model(tmp_path, "b_no_class", GOOD, entry="steps:Cropper")
    python_model(tmp_path, "c_other_file", GOOD, artifact="model.py")
    python_model(tmp_path, "d_bytes", GOOD, outputs=[{"name": "y", "datatype": "BYTES", "shape": [1]}])
    done = models(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    heads = [line.split()[:2] for line in done.stdout.splitlines()[1:] if not line.startswith(" " * 4)]
    assert heads == [["a_good", "ok"], ["b_no_class", "INVALID"], ["c_other_file", "INVALID"], ["d_bytes", "INVALID"]]
    assert "version 1, python steps.py, 1 instance x 1 thread on cpu" in done.stdout
    assert "field 'python.entry': python.entry 'steps:Cropper': steps.py has no class 'Cropper'; it defines Model" \
        in done.stdout
    assert "field 'python.entry': artifact 'model.py' must be the file of the entry's module: python.entry names " \
        "module 'steps', whose file is steps.py" in done.stdout
    assert "field 'outputs.0.datatype': output 'y' is BYTES" in done.stdout
    assert "importing the model prints this" not in done.stdout


def test_without_the_import_what_model_yaml_alone_tells_is_still_said(tmp_path: Path) -> None:
    python_model(tmp_path, "a_good", GOOD)
    python_model(tmp_path, "b_no_class", GOOD, entry="steps:Cropper")
    python_model(tmp_path, "c_other_file", GOOD, artifact="model.py")
    done = models(tmp_path, "--no-factory-check")
    heads = [line.split()[:2] for line in done.stdout.splitlines()[1:] if not line.startswith(" " * 4)]
    assert heads == [["a_good", "ok"], ["b_no_class", "ok"], ["c_other_file", "INVALID"]], done.stdout
    assert done.stdout.count("entry not checked (--no-factory-check)") == 2  # c_other_file: refused by model.yaml
