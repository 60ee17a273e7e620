"""The factory check `servewell models` runs in a child: build on meta, lazy submodules must exist."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from servewell.config.model import ModelConfig
from servewell.runtimes.factory_check import check_factory

FACTORY = textwrap.dedent('''
    import torch

    class Net(torch.nn.Module):
        def __init__(self, hidden=4):
            super().__init__()
            self.body = torch.nn.Linear(4, hidden)
            self.head = torch.nn.Linear(hidden, 2)

    def build(hidden=4):
        return Net(hidden)
''')


@pytest.fixture
def model_dir(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    module = f"factory_check_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(FACTORY)
    return tmp_path


def config(model_dir: Path, **section: Any) -> ModelConfig:
    module = next(model_dir.glob("factory_check_*.py")).stem
    return ModelConfig.model_validate({
        "name": "m", "runtime": "pytorch", "artifact": "w.safetensors",
        "pytorch": {"factory": f"{module}:build", **section},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
    })


def test_a_factory_with_existing_lazy_submodules_passes(model_dir: Path) -> None:
    assert check_factory(config(model_dir, lazy_submodules=["head"]), model_dir) == []


def test_a_lazy_submodule_the_module_lacks_is_named(model_dir: Path) -> None:
    (problem,) = check_factory(config(model_dir, lazy_submodules=["head", "decoder"]), model_dir)
    assert problem.field == "pytorch.lazy_submodules"
    assert problem.reason == ("lazy_submodules ['decoder'] are not submodules of the model; its top-level "
                              "submodules are: body, head")


def test_factory_kwargs_the_factory_does_not_take_are_named(model_dir: Path) -> None:
    (problem,) = check_factory(config(model_dir, factory_kwargs={"width": 3}), model_dir)
    assert problem.field == "pytorch.factory" and "unexpected keyword argument 'width'" in problem.reason


def test_a_factory_that_does_not_exist_is_named(model_dir: Path) -> None:
    module = next(model_dir.glob("factory_check_*.py")).stem
    settings_config = config(model_dir)
    missing = settings_config.model_copy(update={"pytorch": settings_config.pytorch.model_copy(  # type: ignore[union-attr]
        update={"factory": f"{module}:make"})})
    (problem,) = check_factory(missing, model_dir)
    assert problem.field == "pytorch.factory" and "has no 'make'" in problem.reason
