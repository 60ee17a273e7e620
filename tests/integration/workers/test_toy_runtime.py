"""A runtime added by touching one place: the toy runtime of tests/support/toy_runtime.py (numpy, y = x *
factor) is registered here with `register_runtime` and nothing else, and a real worker process behind
its handle loads a model.yaml of `runtime: toy` and answers a batch with it. The worker never
registered the runtime: it learns it from the config it is started with."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from servewell.config.runtimes import RuntimeDescriptor, register_runtime, unregister_runtime
from servewell.engine.repository import read_model_config
from servewell.workers.handle import WorkerHandle
from toy_runtime import TOY, toy_model_yaml


@pytest.fixture
def toy() -> Iterator[RuntimeDescriptor]:
    register_runtime(TOY)
    yield TOY
    unregister_runtime(TOY.name)


def test_a_worker_serves_a_model_of_a_runtime_registered_in_one_place(tmp_path: Path, toy: RuntimeDescriptor):
    directory = tmp_path / "toy"
    directory.mkdir()
    (directory / "toy.txt").write_text("a toy model has no weights\n")
    (directory / "model.yaml").write_text(yaml.safe_dump(toy_model_yaml(factor=3.0)))
    first = np.arange(6, dtype=np.float32).reshape(2, 3)
    second = np.full((1, 3), -1.5, dtype=np.float32)
    stages: list[str] = []

    async def main() -> None:
        handle = WorkerHandle(read_model_config(directory), directory,
                              on_progress=lambda stage, elapsed_s: stages.append(stage))
        try:
            await handle.start(timeout_s=120)  # warm-up included: the toy model ran its dummy batches
            outcome = await handle.run({"x": [first, second]})  # two requests' rows, one batch
            np.testing.assert_array_equal(outcome.outputs["y"], np.concatenate([first, second]) * 3.0)
        finally:
            await handle.stop()

    asyncio.run(main())
    assert "toy" in stages  # the toy backend's own load step, reported from the worker
