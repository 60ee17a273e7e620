"""The python runtime: a class of the model directory runs the batches; what it returns is converted
to and checked against model.yaml; a failing setup, a missing class or module, a SystemExit, a
teardown and two models with modules of the same name, each against a model written into a tmp dir."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from servewell.config.model import ModelConfig
from servewell.runtimes import ModelLoadError, load_runtime
from servewell.runtimes.base import ModelOutputError, ModelRuntime, describe_failure
from servewell.runtimes.entry_check import check_entry
from servewell.runtimes.warmup import warm_up

SCALER = '''
import json
from pathlib import Path

import numpy as np


class Scaler:
    """y = x * factor; records what setup got, and that teardown ran, in files the test names."""

    def setup(self, config):
        self.factor = config["settings"]["factor"]
        self.record = config["settings"].get("record")
        if self.record:
            Path(self.record).write_text(json.dumps(config))

    def execute(self, inputs):
        return {"y": inputs["x"] * self.factor}

    def teardown(self):
        if self.record:
            Path(self.record + ".closed").write_text("closed")
'''


def python_model(root: Path, source: str, *, entry: str = "steps:Model", artifact: str = "steps.py",
                 **fields: Any) -> tuple[ModelConfig, Path]:
    """A python model in `root / name` (fields: model.yaml's, `settings` for python.settings)."""
    name = fields.pop("name", "m")
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / artifact).parent.mkdir(parents=True, exist_ok=True)
    (directory / artifact).write_text(textwrap.dedent(source))
    doc = {
        "name": name, "runtime": "python", "artifact": artifact,
        "python": {"entry": entry, "settings": fields.pop("settings", {})},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}], "max_batch_size": 8, **fields,
    }
    (directory / "model.yaml").write_text(yaml.safe_dump(doc))
    return ModelConfig.model_validate(doc), directory


def load(config: ModelConfig, directory: Path) -> ModelRuntime:
    return load_runtime(config, directory, lambda stage: None)


def returning(expression: str) -> str:
    """A model whose execute returns `expression` (x: the input batch)."""
    return f"import numpy as np\n\nclass Model:\n    def execute(self, inputs):\n        x = inputs['x']\n" \
           f"        return {expression}\n"


def batch(rows: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)}


def test_a_batch_runs_through_the_class_set_up_with_the_model_settings(tmp_path: Path) -> None:
    record = tmp_path / "setup.json"
    config, directory = python_model(tmp_path, SCALER, entry="steps:Scaler",
                                     settings={"factor": 3, "record": str(record)}, version="7")
    runtime = load(config, directory)
    out = runtime.run(batch())
    assert out["y"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], batch()["x"] * 3)
    given = json.loads(record.read_text())
    assert given == {"name": "m", "version": "7", "directory": str(directory),
                     "settings": {"factor": 3, "record": str(record)},
                     "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
                     "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
                     "max_batch_size": 8, "device": "cpu"}
    assert not Path(str(record) + ".closed").exists()
    runtime.close()
    assert Path(str(record) + ".closed").read_text() == "closed"


def test_teardown_runs_once_and_its_failure_does_not_escape_close(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    config, directory = python_model(tmp_path, f'''
        class Model:
            def execute(self, inputs):
                return {{"y": inputs["x"]}}

            def teardown(self):
                with open({str(marks)!r}, "a") as f:
                    f.write("t")
                raise RuntimeError("teardown broke")
    ''')
    runtime = load(config, directory)
    runtime.close()
    runtime.close()
    assert marks.read_text() == "t"


@pytest.mark.parametrize(("expression", "dtype"), [
    ("{'y': x.astype(np.float64)}", np.float32),  # float64 -> FP32: precision only
    ("{'y': x.tolist()}", np.float32),  # a list becomes an array
    ("{'y': x.astype(np.int64)}", np.float32),  # integers are numbers too
])
def test_outputs_are_converted_to_the_declared_dtype_when_nothing_but_precision_is_lost(
        tmp_path: Path, expression: str, dtype: type) -> None:
    config, directory = python_model(tmp_path, returning(expression))
    out = load(config, directory).run(batch())
    assert out["y"].dtype == dtype
    np.testing.assert_array_equal(out["y"], batch()["x"])


@pytest.mark.parametrize(("expression", "datatype", "reason"), [
    ("{'y': x + 0.5}", "INT64", "float32 does not convert to int64 without losing values"),
    ("{'y': x.astype(np.float64) + 1e300}", "FP16", "cannot be converted to FP16"),  # overflows float16
    ("{'y': x.astype(np.int64) + 300}", "UINT8", "outside UINT8's range"),
    ("{'y': np.array([['a', 'b']] * len(x))}", "FP32", "cannot be converted to FP32"),
    ("{'y': [[1.0], [2.0, 3.0]] + [[0.0, 0.0]] * (len(x) - 2)}", "FP32", "is not an array"),  # ragged
])
def test_an_output_that_cannot_be_converted_is_an_error_naming_it(
        tmp_path: Path, expression: str, datatype: str, reason: str) -> None:
    config, directory = python_model(tmp_path, returning(expression),
                                     outputs=[{"name": "y", "datatype": datatype, "shape": [2]}])
    runtime = load(config, directory)
    with pytest.raises(ModelOutputError, match=f"output 'y'.*{reason}"):
        runtime.run(batch())


def test_missing_and_undeclared_outputs_are_named(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, returning("{'z': x, 'w': x}"),
                                     outputs=[{"name": "y", "datatype": "FP32", "shape": [2]},
                                              {"name": "w", "datatype": "FP32", "shape": [2]}])
    with pytest.raises(ModelOutputError, match=r"missing 'y'; not declared 'z'") as info:
        load(config, directory).run(batch())
    assert "'w'" not in str(info.value).split(":", 1)[1]  # the declared one returned is not named as a problem


def test_something_other_than_a_dict_is_refused(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, returning("x"))
    with pytest.raises(ModelOutputError, match=r"execute returned ndarray; it must return a dict .* \['y'\]"):
        load(config, directory).run(batch())


@pytest.mark.parametrize(("expression", "message"), [
    ("{'y': x[:2]}", r"shape \[2, 2\], model.yaml expects \[3, 2\] \(a batch of 3 rows, each \[2\]\)"),
    ("{'y': x[:, :1]}", r"shape \[3, 1\], model.yaml expects \[3, 2\]"),
    ("{'y': x[0]}", r"shape \[2\], model.yaml expects \[3, 2\]"),
])
def test_an_output_whose_rows_or_shape_differ_is_an_error(tmp_path: Path, expression: str, message: str) -> None:
    config, directory = python_model(tmp_path, returning(expression))
    with pytest.raises(ModelOutputError, match=message):
        load(config, directory).run(batch(3))


def test_variable_dimensions_take_any_size_and_a_model_without_batches_has_no_row_dimension(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, returning("{'y': np.zeros((len(x), 5))}"),
                                     outputs=[{"name": "y", "datatype": "FP32", "shape": [-1]}])
    assert load(config, directory).run(batch(4))["y"].shape == (4, 5)
    config, directory = python_model(tmp_path / "unbatched", returning("{'y': x * 2}"), max_batch_size=0)
    out = load(config, directory).run({"x": np.ones(2, dtype=np.float32)})
    np.testing.assert_array_equal(out["y"], [2.0, 2.0])


def test_an_exception_in_execute_propagates_with_the_model_line_and_the_runtime_serves_on(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, '''
        class Model:
            def execute(self, inputs):
                x = inputs["x"]
                if (x == 13).any():
                    raise KeyError("unlucky")
                return {"y": x}
    ''')
    runtime = load(config, directory)
    with pytest.raises(KeyError) as info:
        runtime.run({"x": np.full((1, 2), 13, dtype=np.float32)})
    assert describe_failure(info.value) == "KeyError: 'unlucky' (at steps.py:6)"
    assert runtime.run(batch(1))["y"].shape == (1, 2)


def test_a_system_exit_in_execute_is_an_ordinary_exception_that_cannot_end_the_worker(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, '''
        import sys

        class Model:
            def execute(self, inputs):
                sys.exit(3)
    ''')
    with pytest.raises(Exception) as info:  # not SystemExit, which the worker would not catch
        load(config, directory).run(batch())
    assert isinstance(info.value, RuntimeError)
    assert describe_failure(info.value) == "execute raised SystemExit: 3 (at steps.py:6)"


def test_an_exception_whose_message_fails_is_still_described(tmp_path: Path) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise TypeError("no text")

    assert describe_failure(Unprintable()) == "Unprintable: Unprintable"


def test_a_failing_setup_is_a_load_error_with_type_message_and_line(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, '''
        class Model:
            def setup(self, config):
                labels = config["settings"]["labels"]

            def execute(self, inputs):
                return {"y": inputs["x"]}
    ''')
    with pytest.raises(ModelLoadError, match=r"^Model.setup failed: KeyError: 'labels' \(at steps.py:4\)$"):
        load(config, directory)


def test_a_system_exit_in_setup_or_at_import_is_a_load_error(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, '''
        class Model:
            def setup(self, config):
                raise SystemExit("bye")

            def execute(self, inputs):
                return {}
    ''')
    with pytest.raises(ModelLoadError, match=r"Model.setup failed: SystemExit: bye \(at steps.py:4\)"):
        load(config, directory)
    config, directory = python_model(tmp_path / "b", "raise SystemExit(2)\n")
    with pytest.raises(ModelLoadError, match=r"cannot import steps.py: SystemExit: 2 \(at steps.py:1\)"):
        load(config, directory)


def test_a_class_that_needs_arguments_says_it_is_made_without(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, '''
        class Model:
            def __init__(self, factor):
                self.factor = factor

            def execute(self, inputs):
                return {}
    ''')
    with pytest.raises(ModelLoadError, match=r"Model\(\) failed: TypeError: .*factor.*instantiated without arguments"):
        load(config, directory)


@pytest.mark.parametrize(("source", "entry", "artifact", "message"), [
    ("class Other:\n    def execute(self, inputs): ...\n", "steps:Model", "steps.py",
     r"python.entry 'steps:Model': steps.py has no class 'Model'; it defines Other"),
    ("Model = 3\n", "steps:Model", "steps.py", r"'Model' in steps.py is a int, not a class"),
    ("class Model:\n    pass\n", "steps:Model", "steps.py", r"class Model has no execute\(inputs\) method"),
    ("import not_a_module_anywhere\n", "steps:Model", "steps.py",
     r"cannot import steps.py: ModuleNotFoundError: No module named 'not_a_module_anywhere' \(at steps.py:1\)$"),
    ("def broken(:\n", "steps:Model", "steps.py",
     r"cannot import steps.py: SyntaxError: .*\(steps.py, line 1\)$"),
])
def test_a_missing_module_class_or_method_is_a_load_error_saying_what_is_missing(
        tmp_path: Path, source: str, entry: str, artifact: str, message: str) -> None:
    config, directory = python_model(tmp_path, source, entry=entry, artifact=artifact)
    before = set(sys.modules)
    with pytest.raises(ModelLoadError, match=message):
        load(config, directory)
    assert check_entry(config, directory)[0].field == "python.entry"  # `servewell models` says the same
    assert set(sys.modules) <= before  # nothing of the failed load left behind


@pytest.mark.parametrize(("entry", "artifact", "fields", "where", "message"), [
    ("other:Model", "steps.py", {}, "python.entry",
     "artifact 'steps.py' must be the file of the entry's module: python.entry names module 'other', whose file "
     "is other.py (the artifact's stem must equal the entry's module)"),
    ("steps:Model", "steps.txt", {}, "python.entry", "'steps.txt' is not a .py file"),
    ("steps:Model", "steps.py", {"outputs": [{"name": "y", "datatype": "BYTES", "shape": [1]}]},
     "outputs.0.datatype", "output 'y' is BYTES: a python model takes and returns numeric"),
])
def test_what_model_yaml_alone_tells_is_refused_with_the_file(
        tmp_path: Path, entry: str, artifact: str, fields: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        python_model(tmp_path, returning("{'y': x}"), entry=entry, artifact=artifact, **fields)
    found = {".".join(str(p) for p in e["loc"]): e["msg"] for e in refused.value.errors()}
    assert message in found[where]


def test_modules_of_the_same_name_in_two_models_and_an_installed_name_do_not_meet(tmp_path: Path) -> None:
    before = set(sys.modules)
    first, first_dir = python_model(tmp_path, returning("{'y': x * 2}"), name="first")
    second, second_dir = python_model(tmp_path, returning("{'y': x * 5}"), name="second")
    # A model's module named like a module of the standard library is the model's, and only the model's.
    third, third_dir = python_model(tmp_path, returning("{'y': x + 1}"), name="third", entry="json:Model",
                                    artifact="json.py")
    runtimes = [load(config, directory) for config, directory in
                ((first, first_dir), (second, second_dir), (third, third_dir))]
    answers = [runtime.run(batch(1))["y"] for runtime in runtimes]
    np.testing.assert_array_equal(answers[0], [[0, 2]])
    np.testing.assert_array_equal(answers[1], [[0, 5]])
    np.testing.assert_array_equal(answers[2], [[1, 2]])
    assert json.dumps([1]) == "[1]" and "steps" not in sys.modules
    assert len(set(sys.modules) - before) == 6  # each model: its package and its module
    for runtime in runtimes:
        runtime.close()
    assert set(sys.modules) <= before


def test_siblings_import_relatively_and_a_plain_sibling_import_gets_a_hint(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, '''
        from . import helpers
        from .lib.scale import factor

        class Model:
            def execute(self, inputs):
                return {"y": helpers.shift(inputs["x"]) * factor}
    ''')
    (directory / "helpers.py").write_text("def shift(x):\n    return x + 1\n")
    (directory / "lib").mkdir()
    (directory / "lib" / "scale.py").write_text("factor = 10\n")
    np.testing.assert_array_equal(load(config, directory).run(batch(1))["y"], [[10, 20]])
    config, directory = python_model(tmp_path / "plain", "import helpers\n")
    (directory / "helpers.py").write_text("")
    with pytest.raises(ModelLoadError, match=r"'helpers' is a module of the model directory, which is not on "
                                             r"sys.path: import it relatively \(from . import helpers\)"):
        load(config, directory)


def test_a_dotted_entry_names_a_module_in_a_package_of_the_directory(tmp_path: Path) -> None:
    config, directory = python_model(tmp_path, returning("{'y': x * 4}"), entry="pkg.steps:Model",
                                     artifact="pkg/steps.py")
    np.testing.assert_array_equal(load(config, directory).run(batch(1))["y"], [[0, 4]])


def test_warm_up_runs_the_declared_inputs_and_names_the_model_line_when_it_fails(tmp_path: Path) -> None:
    inputs = [{"name": "page", "datatype": "UINT8", "shape": [1, -1, -1]}, {"name": "k", "datatype": "INT64",
                                                                            "shape": [1]}]
    source = '''
        import numpy as np

        class Model:
            def execute(self, inputs):
                page, k = inputs["page"], inputs["k"]
                return {"y": page.reshape(len(page), -1).sum(axis=1, keepdims=True).astype(np.int64) + k}
    '''
    config, directory = python_model(tmp_path, source, inputs=inputs, max_batch_size=4,
                                     outputs=[{"name": "y", "datatype": "INT64", "shape": [1]}])
    report = warm_up(load(config, directory), config)
    assert [size for size, _ in report.latency_by_batch] == [1, 2, 4]
    config, directory = python_model(tmp_path / "b", returning("{'y': x / inputs['missing']}"))
    with pytest.raises(ModelLoadError, match=r"warm-up batch of 1 failed: KeyError: 'missing' \(at steps.py:6\)"):
        warm_up(load(config, directory), config)
