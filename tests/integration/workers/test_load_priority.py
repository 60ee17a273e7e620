"""A model load at idle priority (the server's `load_cpu_policy: idle`; workers/process_main.py
`run_at_idle`), with real worker processes and a tiny ONNX model: on one thread it loads on a
SCHED_IDLE thread, then every thread of the worker serves at normal priority and the answers are
exact; a model whose load would leave threads at idle (two threads) loads at normal; a load
starved by a busy core (the worker pinned to a core a busy process holds) starts over at normal
priority and the model serves. Only public interfaces are used."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper

from model_dirs import onnx_mlp_model
from pool_listener import Listener
from servewell.engine.repository import read_model_config
from servewell.workers.handle import WorkerHandle, WorkerLoadError, WorkerLoadStarved, WorkerSettings
from servewell.workers.pool import WorkerPool

#: Seconds a worker may take to come up on a loaded 2-core machine (it imports onnxruntime).
READY_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's"),
              pytest.mark.serial]  # an idle-priority load on a busy machine starts over at normal


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_mlp_model(tmp_path_factory.mktemp("repo"), "tiny")


def expected_rows(rows: np.ndarray) -> np.ndarray:
    torch.manual_seed(0)  # onnx_mlp_model's seeded nn.Linear(4, 3)
    linear = torch.nn.Linear(4, 3)
    return linear(torch.from_numpy(rows)).detach().numpy()


def thread_policies(pid: int) -> dict[int, int]:
    """Each thread of process `pid` and its scheduling policy."""
    return {int(task.name): os.sched_getscheduler(int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.parametrize(("threads", "loaded_at"), [(1, "idle"), (2, "normal")])
def test_an_idle_load_leaves_every_thread_serving_at_normal_priority(onnx_dir, threads, loaded_at):
    config = read_model_config(onnx_dir).model_copy(update={"threads": threads})
    rows = np.random.default_rng(3).normal(size=(3, 4)).astype(np.float32)

    async def main() -> None:
        handle = WorkerHandle(config, onnx_dir, settings=WorkerSettings(load_cpu_policy="idle"))
        try:
            ready = await handle.start(READY_TIMEOUT_S)
            assert ready.loaded_at == loaded_at
            outcome = await handle.run({"x": [rows]})
            np.testing.assert_allclose(outcome.outputs["y"], expected_rows(rows), rtol=1e-5, atol=1e-6)
            # The load's own thread ends with the load (Python marks it finished a moment before
            # the kernel's task is gone: CI once saw it still there): nothing then runs at idle.
            ends_at = time.monotonic() + 10
            while os.SCHED_IDLE in thread_policies(ready.pid).values() and time.monotonic() < ends_at:
                await asyncio.sleep(0.05)
            policies = thread_policies(ready.pid)
            assert len(policies) >= 2 and set(policies.values()) == {os.SCHED_OTHER}, policies
        finally:
            await handle.stop()

    asyncio.run(main())


HOG = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def heavy_model(root: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """An ONNX MLP with 48 MiB of weights (a load of some 0.1 s of CPU: long enough that a starved
    one is seen starving; the tiny model's took a few milliseconds); its two weight matrices."""
    hidden = 48 * 2**20 // (4 * (4 + 3))
    rng = np.random.default_rng(11)
    w1 = (rng.random((4, hidden), dtype=np.float32) - 0.5) * np.float32(0.05)
    w2 = (rng.random((hidden, 3), dtype=np.float32) - 0.5) * np.float32(0.05)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])], "heavy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    directory = root / "heavy"
    directory.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(directory / "model.onnx"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 2, "threads": 1,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}))
    return directory, w1, w2


def test_a_starved_idle_load_starts_over_at_normal_priority(tmp_path, caplog):
    """The worker is pinned to one core that a busy process at normal priority holds: an idle
    thread there gets almost nothing (measured: 3 ms of CPU a half second), so the load gives up on
    idle and the pool loads the model again at normal priority (the worker's own), which shares
    the core."""
    directory, w1, w2 = heavy_model(tmp_path)
    core = sorted(os.sched_getaffinity(0))[0]
    config = read_model_config(directory).model_copy(update={"cpu_affinity": [core]})
    rows = np.random.default_rng(4).normal(size=(2, 4)).astype(np.float32)
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(core)])

    async def main() -> None:
        listener = Listener()
        pool = WorkerPool(config, directory, listener, READY_TIMEOUT_S, WorkerSettings(load_cpu_policy="idle"))
        try:
            await pool.start()
            (worker,) = listener.ready
            breakdown = pool.last_start_breakdown
            assert breakdown is not None and breakdown.loaded_at == "normal" and breakdown.pid == worker.pid
            outcome = await worker.run({"x": [rows]})
            np.testing.assert_allclose(outcome.outputs["y"], rows @ w1 @ w2, rtol=1e-4, atol=1e-5)
        finally:
            await pool.stop()

    try:
        with caplog.at_level(logging.WARNING, logger="servewell.workers"):
            asyncio.run(main())
    finally:
        hog.kill()
        hog.wait(10)
    starved = [r for r in caplog.records if getattr(r, "event", None) == "load_starved"]
    assert len(starved) == 1, [r.getMessage() for r in caplog.records]
    assert "waited for a core" in starved[0].getMessage() and "again at normal priority" in starved[0].getMessage()


def test_a_load_that_fails_on_the_idle_thread_fails_the_start_with_the_reason(onnx_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in onnx_dir.iterdir():
        (broken / path.name).write_bytes(b"this is not an onnx file" if path.suffix == ".onnx" else path.read_bytes())

    async def main() -> None:
        handle = WorkerHandle(read_model_config(broken), broken, settings=WorkerSettings(load_cpu_policy="idle"))
        try:
            with pytest.raises(WorkerLoadError) as failed:
                await handle.start(READY_TIMEOUT_S)
            assert not isinstance(failed.value, WorkerLoadStarved)
            assert "model.onnx" in str(failed.value)  # the file, and why (from onnxruntime)
        finally:
            await handle.stop()

    asyncio.run(main())
