"""A worker keeps to its model's `threads` in the BLAS numpy brought before the worker knew its
model (workers/process_main.py imports numpy, and a spare imports it before it is adopted): a
python model doing matrix products in a real worker sees the BLAS pool at `threads` (before, at
every CPU: OpenBLAS's idle threads spin, and a `threads: 1` worker took a second core)."""

from __future__ import annotations

import asyncio
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from threadpoolctl import threadpool_info

from servewell.engine.repository import read_model_config
from servewell.workers.handle import WorkerHandle

PROBE = textwrap.dedent('''
    import os

    import numpy as np
    from threadpoolctl import threadpool_info


    class Probe:
        """y = [BLAS threads numpy's pool uses, threads of this process after a large product]."""

        def execute(self, inputs):
            a = np.ones((512, 512))
            for _ in range(4):
                a = a @ a / 512.0  # large enough for OpenBLAS to run it on every thread it has
            blas = max((pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"), default=0)
            rows = len(inputs["x"])
            return {"y": np.tile(np.array([blas, len(os.listdir("/proc/self/task"))], np.int64), (rows, 1))}
''')


def probe_model(root: Path, threads: int) -> Path:
    directory = root / f"probe{threads}"
    directory.mkdir()
    (directory / "probe.py").write_text(PROBE)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "probe.py", "python": {"entry": "probe:Probe"}, "threads": threads,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [2]}], "max_batch_size": 1, "warmup": False,
    }))
    return directory


def blas_threads_here() -> int:
    return max((pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"), default=0)


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or blas_threads_here() < 2,
                    reason="one CPU (or a single-threaded BLAS): every pool is one thread already")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_models_threads_size_the_blas_pool_its_numpy_products_run_on(tmp_path: Path, threads: int) -> None:
    directory = probe_model(tmp_path, threads)

    async def main() -> np.ndarray:
        handle = WorkerHandle(read_model_config(directory), directory)
        try:
            await handle.start(timeout_s=120)
            outcome = await handle.run({"x": [np.zeros((1, 1), np.float32)]})
            return np.asarray(outcome.outputs["y"])[0]
        finally:
            await handle.stop()

    blas, process_threads = asyncio.run(main())
    assert blas == threads  # before: the pool numpy's import sized to every CPU (2 here) whatever `threads` said
    assert process_threads >= 2  # the probe ran in the worker (its main thread and heartbeat at least)
