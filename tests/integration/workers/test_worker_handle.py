"""One real worker process behind its handle, on a tiny ONNX model built here: it loads and
reports ready, runs a batch made of several requests' rows and returns exactly what the model
computes, fails its start with the reason when the model cannot load, and is noticed at once
when it dies. Only the handle's public interface is used."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from processes import thread_nices
from servewell.engine.repository import read_model_config
from servewell.errors import WorkerLost
from servewell.workers.handle import WorkerHandle, WorkerLoadError

#: A model that, once `armed` exists, closes every file descriptor of its process (its pipe to the
#: frontend among them) on its next batch and stays alive until `release` exists, then exits 7.
LINGERING_FACTORY = textwrap.dedent('''
    import os
    import time

    import torch
    from torch import nn


    class Lingering(nn.Module):
        def __init__(self, armed: str, release: str):
            super().__init__()
            self.armed, self.release = armed, release
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            if os.path.exists(self.armed):
                os.closerange(3, 65536)
                ends_at = time.monotonic() + 60
                while not os.path.exists(self.release) and time.monotonic() < ends_at:
                    time.sleep(0.01)
                os._exit(7)
            return x * self.scale


    def build(armed: str, release: str):
        return Lingering(armed, release)
''')


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


def test_a_worker_that_lingers_after_its_pipe_closes_does_not_stall_the_loop(tmp_path):
    """The pipe closes before the process can be reaped: the loop keeps running meanwhile (it used to
    wait for the exit in `process.join` on the loop: here for as long as the process lived), and
    the exit code is still what the batch's error and `exit_reason` say once the process exits."""
    directory = tmp_path / "lingering"
    directory.mkdir()
    (directory / "factory.py").write_text(LINGERING_FACTORY)
    save_file({"scale": torch.ones(1)}, str(directory / "model.safetensors"))
    armed, release = tmp_path / "armed", tmp_path / "release"
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors", "max_batch_size": 1,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        "pytorch": {"factory": "factory:build", "factory_kwargs": {"armed": str(armed), "release": str(release)}},
    }))

    async def main() -> None:
        lost = asyncio.Event()
        handle = WorkerHandle(read_model_config(directory), directory, on_lost=lambda worker: lost.set())
        try:
            await handle.start(timeout_s=120)
            pid = handle.pid
            assert pid is not None
            armed.touch()
            batch = asyncio.ensure_future(handle.run({"x": [np.ones((1, 1), dtype=np.float32)]}))
            ends_at = time.monotonic() + 30
            while handle.alive and time.monotonic() < ends_at:
                await asyncio.sleep(0.01)
            assert not handle.alive  # its pipe closed
            # The loop runs again while the process is still alive (it waits for `release`): the
            # loss was not waited out on the loop.
            assert not process_gone(pid)
            release.touch()
            await asyncio.wait_for(lost.wait(), 30)
            with pytest.raises(WorkerLost, match="exit code 7"):
                await batch
            assert handle.exit_reason == "exit code 7"
        finally:
            await handle.stop()

    asyncio.run(main())


MAIN_WITH_SIDE_EFFECTS = textwrap.dedent('''
    import asyncio, sys
    from pathlib import Path

    if __name__ == "__mp_main__":  # multiprocessing re-importing this file in a child
        Path(sys.argv[2]).write_text("re-imported")

    from servewell.engine.repository import read_model_config
    from servewell.workers.handle import WorkerHandle

    async def main():
        directory = Path(sys.argv[1])
        handle = WorkerHandle(read_model_config(directory), directory)
        await handle.start(120)
        await handle.stop()
        print("ready", flush=True)

    if __name__ == "__main__":
        asyncio.run(main())
''')


def test_a_worker_does_not_re_import_the_main_module_of_the_server(tmp_path, linear):
    """The split server's main module is `servewell.engine_main` (the whole server): a worker that
    re-imported it spent seconds before loading anything."""
    directory = model_dir(tmp_path, linear)
    script, marker = tmp_path / "server_main.py", tmp_path / "re-imported"
    script.write_text(MAIN_WITH_SIDE_EFFECTS)
    done = subprocess.run([sys.executable, str(script), str(directory), str(marker)], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and "ready" in done.stdout, done.stderr[-3000:]  # the worker loaded
    assert not marker.exists()


@pytest.mark.parametrize("threads", [1, 2])
def test_every_thread_of_a_worker_runs_at_its_nice(tmp_path, linear, threads):
    """A worker's `nice` (default 5) lowers every thread: those numpy's OpenBLAS started at import,
    before the worker lowered itself, kept nice 0 when only the calling thread was lowered; those
    onnxruntime starts later (its pool with two threads) inherit it."""
    directory = model_dir(tmp_path, linear)
    config = read_model_config(directory).model_copy(update={"threads": threads})
    worker_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + config.nice)

    async def main() -> None:
        handle = WorkerHandle(config, directory)
        try:
            ready = await handle.start(timeout_s=120)
            outcome = await handle.run({"x": [np.ones((2, 4), np.float32)]})
            assert outcome.outputs["y"].shape == (2, 3)
            nices = thread_nices(ready.pid)
            assert len(nices) >= 2 and set(nices.values()) == {worker_nice}, nices
        finally:
            await handle.stop()

    asyncio.run(main())
