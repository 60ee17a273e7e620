"""Spare worker processes (workers/spare.py) with real processes and a tiny ONNX model: a pool's
start adopts a ready spare (the worker's pid is the spare's) and the model answers exactly; the
set refills; stopping it leaves no process behind, nor does killing the process that owns it; a
spare that dies idle is replaced; a model that needs a fresh spawn gets one; every start reports
where its time went. Only public interfaces are used."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model_dirs import onnx_mlp_model, torchscript_mlp_model
from pool_listener import Listener
from processes import thread_nices
from servewell.engine.repository import read_model_config
from servewell.workers.handle import WorkerHandle, WorkerSettings
from servewell.workers.pool import WorkerPool
from servewell.workers.spare import SpareWorkers

#: Seconds a spare may take to come up on a loaded 2-core machine (it imports onnxruntime).
READY_TIMEOUT_S = 120.0


def process_gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" in status.read_text().lower()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return True


async def wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    ends_at = time.monotonic() + timeout_s
    while not all(process_gone(pid) for pid in pids) and time.monotonic() < ends_at:
        await asyncio.sleep(0.02)
    assert all(process_gone(pid) for pid in pids), [pid for pid in pids if not process_gone(pid)]


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_mlp_model(tmp_path_factory.mktemp("repo"), "tiny")


def expected_rows(rows: np.ndarray) -> np.ndarray:
    torch.manual_seed(0)  # onnx_mlp_model's seeded nn.Linear(4, 3)
    linear = torch.nn.Linear(4, 3)
    return linear(torch.from_numpy(rows)).detach().numpy()


def test_a_pool_adopts_a_ready_spare_which_answers_and_the_set_refills(onnx_dir):
    rows = np.random.default_rng(5).normal(size=(3, 4)).astype(np.float32)

    async def main() -> None:
        spares = SpareWorkers(1)
        spares.start()
        pool = None
        try:
            await spares.wait_ready(READY_TIMEOUT_S)
            (spare_pid,) = spares.ready_pids
            listener = Listener()
            config = read_model_config(onnx_dir)
            pool = WorkerPool(config, onnx_dir, listener, READY_TIMEOUT_S, WorkerSettings(spares=spares))
            await pool.start()
            (worker,) = listener.ready
            assert worker.pid == spare_pid  # the spare became the model's worker
            # It runs at the worker's nice on every thread, those the spare started before too.
            assert set(thread_nices(spare_pid).values()) == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + config.nice)}
            outcome = await worker.run({"x": [rows]})
            np.testing.assert_allclose(outcome.outputs["y"], expected_rows(rows), rtol=1e-5, atol=1e-6)
            breakdown = pool.last_start_breakdown
            assert breakdown is not None and breakdown.spare and breakdown.pid == spare_pid
            assert breakdown.fresh_reason == ""
            await spares.wait_ready(READY_TIMEOUT_S)  # refilled in the background
            (refill_pid,) = spares.ready_pids
            assert refill_pid != spare_pid and refill_pid != os.getpid()
        finally:
            if pool is not None:
                await pool.stop()
            spare_pids = list(spares.pids)
            await spares.stop()
        assert spare_pids and all(process_gone(pid) for pid in spare_pids)  # stop waited for their exit
        assert spares.take(read_model_config(onnx_dir)) is None  # a stopped set hands out nothing
        await wait_gone([spare_pid])

    asyncio.run(main())


def test_a_torch_model_adopts_a_spare_too(tmp_path):
    """The spare imported onnxruntime only; a TorchScript model imports torch after adoption."""
    directory = torchscript_mlp_model(tmp_path, "ts")
    rows = np.ones((2, 4), dtype=np.float32)

    async def main() -> None:
        spares = SpareWorkers(1)
        spares.start()
        handle = WorkerHandle(read_model_config(directory), directory, settings=WorkerSettings(spares=spares))
        try:
            await spares.wait_ready(READY_TIMEOUT_S)
            (spare_pid,) = spares.ready_pids
            await handle.start(READY_TIMEOUT_S)
            assert handle.pid == spare_pid
            outcome = await handle.run({"x": [rows]})
            np.testing.assert_allclose(outcome.outputs["y"], expected_rows(rows), rtol=1e-5, atol=1e-6)
            assert handle.cold_start is not None and handle.cold_start.spare
        finally:
            await handle.stop()
            await spares.stop()

    asyncio.run(main())


def test_a_model_that_needs_a_fresh_spawn_gets_one_and_the_spare_stays(tmp_path):
    """allocator jemalloc goes in LD_PRELOAD before the interpreter starts: a spare cannot give it."""
    directory = onnx_mlp_model(tmp_path, "jemalloc", allocator="jemalloc")

    async def main() -> None:
        spares = SpareWorkers(1)
        spares.start()
        handle = WorkerHandle(read_model_config(directory), directory, settings=WorkerSettings(spares=spares))
        try:
            await spares.wait_ready(READY_TIMEOUT_S)
            (spare_pid,) = spares.ready_pids
            await handle.start(READY_TIMEOUT_S)
            assert handle.pid != spare_pid
            assert spares.ready_pids == (spare_pid,)  # still idle, for a model it suits
            breakdown = handle.cold_start
            assert breakdown is not None and not breakdown.spare and "jemalloc" in breakdown.fresh_reason
        finally:
            await handle.stop()
            await spares.stop()

    asyncio.run(main())


def test_a_fresh_start_reports_where_its_time_went(onnx_dir):
    async def main() -> None:
        handle = WorkerHandle(read_model_config(onnx_dir), onnx_dir)
        try:
            await handle.start(READY_TIMEOUT_S)
            b = handle.cold_start
            assert b is not None and not b.spare and b.pid == handle.pid and b.fresh_reason == "spare_workers is 0"
            # Each step was measured (a process start and an import take time on any machine) and
            # together they are the whole start, give or take the messages.
            assert b.spawn_s > 0 and b.import_s > 0 and b.load_s > 0 and b.warmup_s > 0
            assert b.spawn_s + b.import_s + b.load_s + b.warmup_s <= b.total_s
        finally:
            await handle.stop()

    asyncio.run(main())


def test_the_server_s_first_only_warm_up_reaches_the_worker(onnx_dir):
    async def main() -> None:
        handle = WorkerHandle(read_model_config(onnx_dir), onnx_dir, settings=WorkerSettings(warmup_first_only=True))
        try:
            info = await handle.start(READY_TIMEOUT_S)
            assert [size for size, _ in info.latency_by_batch] == [1, 2]  # max_batch_size 8: 4 and 8 skipped
            assert info.effective_max_batch_size == 8
        finally:
            await handle.stop()

    asyncio.run(main())


def test_a_spare_that_dies_while_idle_is_replaced():
    async def main() -> None:
        spares = SpareWorkers(1)
        spares.start()
        try:
            await spares.wait_ready(READY_TIMEOUT_S)
            (first,) = spares.ready_pids
            os.kill(first, signal.SIGKILL)
            await wait_gone([first])
            ends_at = time.monotonic() + READY_TIMEOUT_S
            while spares.ready_pids in ((), (first,)) and time.monotonic() < ends_at:
                await asyncio.sleep(0.02)
            (second,) = spares.ready_pids
            assert second != first
        finally:
            await spares.stop()

    asyncio.run(main())


OWNER = textwrap.dedent('''
    import asyncio, sys
    from servewell.workers.spare import SpareWorkers

    async def main():
        spares = SpareWorkers(2)
        spares.start()
        await spares.wait_ready(120)
        print(" ".join(map(str, spares.ready_pids)), flush=True)
        await asyncio.sleep(600)  # killed by the test

    if __name__ == "__main__":
        asyncio.run(main())
''')


def test_spares_die_with_the_process_that_owns_them(tmp_path):
    """kill -9 of the engine leaves no spare behind (no `stop` ran)."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert owner.stdout is not None
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and not any(process_gone(pid) for pid in pids)
    finally:
        owner.kill()
        owner.wait(30)
    asyncio.run(wait_gone(pids))


def test_with_no_spare_kept_starts_fork_theirs_from_the_fork_server(onnx_dir):
    # Eager mode keeps no spare; each start used to spawn a fresh interpreter and import numpy and
    # the runtime again (issue 45: 13 models on 2 cores). Now the set forks one for each start.
    rows = np.random.default_rng(6).normal(size=(2, 4)).astype(np.float32)

    async def main() -> None:
        spares = SpareWorkers(0, fork_on_demand=True)
        spares.start()
        pools: list[WorkerPool] = []
        pids: list[int | None] = []
        try:
            config = read_model_config(onnx_dir)
            for _ in range(3):
                listener = Listener()
                pool = WorkerPool(config, onnx_dir, listener, READY_TIMEOUT_S, WorkerSettings(spares=spares))
                pools.append(pool)
                await pool.start()
                (worker,) = listener.ready
                assert pool.last_start_breakdown is not None and pool.last_start_breakdown.spare
                outcome = await worker.run({"x": [rows]})
                np.testing.assert_allclose(outcome.outputs["y"], expected_rows(rows), rtol=1e-5, atol=1e-6)
            assert spares.adopted == 3 and spares.pids == ()  # nothing kept idle once taken
            pids = [p.workers[0].pid for p in pools if p.workers[0] is not None]
            assert len(set(pids)) == 3 and None not in pids
        finally:
            for pool in pools:
                await pool.stop()
            await spares.stop()
        await wait_gone([pid for pid in pids if pid is not None])

    asyncio.run(main())
