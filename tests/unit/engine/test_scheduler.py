"""The scheduler with fake in-process workers: every exit path resolves every future."""

import asyncio

import numpy as np
import pytest

from servewell.config.model import ModelConfig
from servewell.engine.scheduler import ModelScheduler
from servewell.errors import DeadlineExceeded, InvalidInput, ModelError, Overloaded, ShuttingDown, WorkerLost
from servewell.workers.handle import BatchOutcome

HIGH, NORMAL = "high", "normal"


def config(instances: int = 1, **batching) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": 4, "instances": instances,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
        "batching": batching,
    })


class FakeWorker:
    """Doubles its input; a batch finishes when the test releases it."""

    def __init__(self, fail_with=None, delay_s=0.0):
        self.alive = True
        self.delay_s = delay_s
        self.batches: list[list[float]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail_with = fail_with

    async def run(self, parts, traceparent=None):
        x = np.concatenate(parts["x"])
        self.batches.append(x[:, 0].tolist())
        await self.release.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            self.alive = not isinstance(self.fail_with, WorkerLost)
            raise self.fail_with
        return BatchOutcome({"y": x * 2}, compute_s=0.001)


def row(value: float, rows: int = 1) -> dict:
    return {"x": np.full((rows, 2), value, dtype=np.float32)}


def submit(s, value, lane=NORMAL, timeout_ms=None, rows=1):
    return s.submit(row(value, rows), rows, lane, timeout_ms, f"r{value}")


def test_each_request_gets_its_own_rows_back():
    async def main():
        s = ModelScheduler(config())
        worker = FakeWorker()
        worker.release.clear()
        s.add_worker(worker)
        first = submit(s, 1)  # starts at once on the idle worker
        rest = [submit(s, v) for v in (2, 3)]
        await asyncio.sleep(0)
        worker.release.set()
        results = await asyncio.gather(first, *rest)
        assert [r.outputs["y"][0, 0] for r in results] == [2, 4, 6]
        assert worker.batches == [[1], [2, 3]]
        assert results[1].batch_size == 2
    asyncio.run(main())


def test_urgent_request_overtakes_a_full_normal_queue():
    async def main():
        s = ModelScheduler(config())
        worker = FakeWorker()
        worker.release.clear()
        s.add_worker(worker)
        running = submit(s, 0)
        queued = [submit(s, v) for v in range(1, 9)]
        urgent = submit(s, 99, lane=HIGH)
        await asyncio.sleep(0)
        worker.release.set()
        await asyncio.gather(running, urgent, *queued)
        assert worker.batches[1][0] == 99  # next batch after the running one is led by the urgent request
    asyncio.run(main())


def test_window_policy_waits_for_a_fuller_batch_but_high_lane_does_not():
    async def main():
        s = ModelScheduler(config(policy="window", max_wait_ms=50))
        worker = FakeWorker()
        s.add_worker(worker)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        a, b = submit(s, 1), submit(s, 2)
        await asyncio.gather(a, b)
        assert loop.time() - t0 >= 0.045  # waited for the window
        assert worker.batches == [[1, 2]]
        t1 = loop.time()
        await submit(s, 3, lane=HIGH)
        assert loop.time() - t1 < 0.04  # high lane never waits for a window
    asyncio.run(main())


def test_window_closes_early_when_the_batch_is_full():
    async def main():
        s = ModelScheduler(config(policy="window", max_wait_ms=5000))
        worker = FakeWorker()
        s.add_worker(worker)
        results = await asyncio.wait_for(asyncio.gather(*(submit(s, v) for v in range(4))), timeout=1)
        assert len(results) == 4 and worker.batches == [[0, 1, 2, 3]]
    asyncio.run(main())


def test_expired_request_is_answered_at_once_and_never_reaches_the_model():
    async def main():
        s = ModelScheduler(config())
        worker = FakeWorker()
        worker.release.clear()
        s.add_worker(worker)
        busy = submit(s, 0)
        doomed = submit(s, 1, timeout_ms=20)
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(doomed, timeout=1)  # resolved while the worker is still busy
        worker.release.set()
        await busy
        assert worker.batches == [[0]]
    asyncio.run(main())


def test_cancelled_request_is_dropped_before_compute():
    async def main():
        s = ModelScheduler(config())
        worker = FakeWorker()
        worker.release.clear()
        s.add_worker(worker)
        busy = submit(s, 0)
        gone = submit(s, 1)
        kept = submit(s, 2)
        gone.cancel()
        await asyncio.sleep(0)
        worker.release.set()
        await asyncio.gather(busy, kept)
        assert worker.batches == [[0], [2]]
    asyncio.run(main())


def test_full_lane_is_refused_with_retry_after():
    async def main():
        s = ModelScheduler(config(max_queue_size=2))
        submit(s, 1), submit(s, 2)  # no worker yet: both stay queued
        with pytest.raises(Overloaded) as info:
            submit(s, 3)
        assert info.value.retry_after_s >= 1
        submit(s, 4, lane=HIGH)  # the high lane has its own bound
    asyncio.run(main())


def test_worker_loss_fails_its_batch_and_model_errors_fail_theirs():
    async def main():
        s = ModelScheduler(config())
        s.add_worker(FakeWorker(fail_with=WorkerLost("gone")))
        with pytest.raises(WorkerLost):
            await submit(s, 1)
        s2 = ModelScheduler(config())
        s2.add_worker(FakeWorker(fail_with=ModelError("boom")))
        with pytest.raises(ModelError):
            await submit(s2, 1)
    asyncio.run(main())


def test_drain_finishes_queued_work_then_refuses_new_requests():
    async def main():
        s = ModelScheduler(config())
        worker = FakeWorker()
        worker.release.clear()
        s.add_worker(worker)
        pending = [submit(s, v) for v in range(6)]
        drained = asyncio.ensure_future(s.drain())
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDown):
            submit(s, 7)
        worker.release.set()
        await drained
        assert all(p.done() and not p.exception() for p in pending)
    asyncio.run(main())


def test_reserved_instance_serves_urgent_requests_while_the_other_is_busy():
    async def main():
        s = ModelScheduler(config(instances=2, reserve_instance_for_high=True))
        general, reserved = FakeWorker(), FakeWorker()
        general.release.clear()
        s.add_worker(general)
        s.add_worker(reserved)  # the second instance becomes the reserved one
        busy = submit(s, 0)
        queued = [submit(s, v) for v in range(1, 6)]
        urgent = await asyncio.wait_for(submit(s, 99, lane=HIGH), timeout=1)
        assert urgent.outputs["y"][0, 0] == 198
        assert reserved.batches == [[99]]  # normal work never ran on the reserved instance
        general.release.set()
        await asyncio.gather(busy, *queued)
        assert reserved.batches == [[99]]
    asyncio.run(main())


def test_settings_change_while_serving_without_losing_requests():
    async def main():
        s = ModelScheduler(config(policy="window", max_wait_ms=10_000))
        worker = FakeWorker()
        s.add_worker(worker)
        waiting = [submit(s, v) for v in range(2)]  # held by the long window
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiting)
        s.update({"policy": "idle", "max_batch_size": 2})
        results = await asyncio.wait_for(asyncio.gather(*waiting), timeout=1)
        assert [r.batch_size for r in results] == [2, 2]
        with pytest.raises(InvalidInput):
            s.update({"max_batch_size": 64})  # above what the model was loaded and warmed up with
        with pytest.raises(InvalidInput):
            s.update({"policy": "fastest"})
        assert s.settings()["policy"] == "idle"
    asyncio.run(main())


def test_adaptive_policy_starts_at_once_at_low_load():
    async def main():
        s = ModelScheduler(config(policy="adaptive", max_wait_ms=500, latency_slo_ms=1000))
        s.add_worker(FakeWorker())
        loop = asyncio.get_running_loop()
        for v in range(3):
            t0 = loop.time()
            await submit(s, v)
            await asyncio.sleep(0.05)  # sparse arrivals
            assert loop.time() - t0 < 0.3
    asyncio.run(main())


def test_admission_refuses_a_full_lane_before_any_decoding():
    async def main():
        s = ModelScheduler(config(max_queue_size=1))
        submit(s, 1)  # no worker: stays queued
        with pytest.raises(Overloaded):
            s.admit("normal")
        s.admit("high")  # another lane, its own bound
    asyncio.run(main())


def test_deadline_counts_from_arrival_not_from_queueing():
    async def main():
        s = ModelScheduler(config())
        loop = asyncio.get_running_loop()
        with pytest.raises(DeadlineExceeded):
            s.submit(row(1), 1, NORMAL, 50, "late", arrived_at=loop.time() - 0.1)  # decoding took 100 ms
    asyncio.run(main())


def test_a_request_that_would_finish_after_its_deadline_is_not_run():
    async def main():
        s = ModelScheduler(config())
        worker = FakeWorker(delay_s=0.2)
        s.add_worker(worker)
        await submit(s, -1)  # the scheduler learns that a batch takes about 200 ms
        worker.batches.clear()
        worker.release.clear()
        busy = submit(s, 0, timeout_ms=5000)
        doomed = submit(s, 1, timeout_ms=100)  # queued behind it; 100 ms cannot fit a 200 ms batch
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(doomed, timeout=2)
        worker.release.set()
        await busy
        assert worker.batches == [[0]]
    asyncio.run(main())
