"""One real worker process behind its handle, on a tiny ONNX model built here: it loads and
reports ready, runs a batch made of several requests' rows and returns exactly what the model
computes, fails its start with the reason when the model cannot load, and is noticed at once
when it dies. Only the handle's public interface is used."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from servewell.engine.repository import read_model_config
from servewell.errors import WorkerLost
from servewell.workers.handle import WorkerHandle, WorkerLoadError


@pytest.fixture(scope="module")
def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).eval()


def model_dir(root: Path, linear: torch.nn.Module, artifact: bytes | None = None) -> Path:
    """`root/tiny` with model.yaml and the ONNX export of `linear` (or `artifact`'s bytes)."""
    directory = root / "tiny"
    directory.mkdir()
    if artifact is None:
        torch.onnx.export(linear, (torch.zeros(2, 4),), str(directory / "model.onnx"), dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    else:
        (directory / "model.onnx").write_bytes(artifact)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
    }))
    return directory


def process_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_batch_of_several_requests_rows_comes_back_exactly(tmp_path, linear):
    directory = model_dir(tmp_path, linear)
    stages: list[str] = []
    rng = np.random.default_rng(3)
    first, second = rng.normal(size=(2, 4)).astype(np.float32), rng.normal(size=(3, 4)).astype(np.float32)

    async def main() -> None:
        handle = WorkerHandle(read_model_config(directory), directory,
                              on_progress=lambda stage, elapsed_s: stages.append(stage))
        try:
            ready = await handle.start(timeout_s=120)
            assert handle.alive and ready.pid == handle.pid != os.getpid()
            outcome = await handle.run({"x": [first, second]})  # two requests' rows, one batch
            expected = linear(torch.from_numpy(np.concatenate([first, second]))).detach().numpy()
            assert outcome.outputs["y"].shape == (5, 3)
            np.testing.assert_allclose(outcome.outputs["y"], expected, rtol=1e-5, atol=1e-6)
            assert outcome.compute_s > 0
            again = await handle.run({"x": [second]})  # the shared-memory arena is reused
            np.testing.assert_allclose(again.outputs["y"], expected[2:], rtol=1e-5, atol=1e-6)
        finally:
            await handle.stop()
        assert not handle.alive and process_gone(ready.pid)

    asyncio.run(main())
    assert stages  # loading reported its progress


def test_a_model_that_cannot_load_fails_the_start_with_the_reason(tmp_path, linear):
    directory = model_dir(tmp_path, linear, artifact=b"this is not an onnx file")

    async def main() -> None:
        handle = WorkerHandle(read_model_config(directory), directory)
        try:
            with pytest.raises(WorkerLoadError) as failed:
                await handle.start(timeout_s=120)
            assert "model.onnx" in str(failed.value)  # the file, and why (from onnxruntime)
            assert not handle.alive
        finally:
            await handle.stop()

    asyncio.run(main())


def test_a_worker_that_dies_is_noticed_at_once_and_refuses_batches(tmp_path, linear):
    directory = model_dir(tmp_path, linear)

    async def main() -> None:
        lost = asyncio.Event()
        handle = WorkerHandle(read_model_config(directory), directory, on_lost=lambda worker: lost.set())
        try:
            await handle.start(timeout_s=120)
            handle.kill()
            await asyncio.wait_for(lost.wait(), 30)  # the pipe closed: no polling, no timeout waited out
            assert not handle.alive
            with pytest.raises(WorkerLost):
                await handle.run({"x": [np.zeros((1, 4), dtype=np.float32)]})
        finally:
            await handle.stop()

    asyncio.run(main())
