"""A running batch's budget, with a manual clock: requests are answered at their deadlines while
their batch still runs, a batch past its compute budget gets its runner declared hung, and a
client's short deadline never does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import pytest

from fake_clock import FakeClock
from inference_requests import FAR, request_of
from servewell.config.model import ModelConfig
from servewell.engine.batch_runner import BatchOutcome
from servewell.engine.batch_watch import (
    COMPUTE_BUDGET_FACTOR,
    COMPUTE_BUDGET_FLOOR_S,
    CONFIGURED_BUDGET_MIN_FACTOR,
    UNMEASURED_COMPUTE_BUDGET_S,
    compute_budget_s,
)
from servewell.engine.scheduler import ModelScheduler
from servewell.errors import DeadlineExceeded, WorkerHung

NORMAL = 1


def config(**batching: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        "batching": batching,
    })


class StuckRunner:
    """A runner whose batch runs until the test releases it; it records being declared hung (and
    then fails its batch, as a killed worker's handle does)."""

    def __init__(self) -> None:
        self.alive = True
        self.instance = 0
        self.release = asyncio.Event()
        self.hung: list[str] = []
        self.batches = 0

    async def run(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                  deadlines: Sequence[float] = ()) -> BatchOutcome:
        self.batches += 1
        x = np.concatenate(parts["x"])
        await self.release.wait()
        if self.hung:
            raise WorkerHung("killed")
        return BatchOutcome({"y": x * 2}, compute_s=0.001)

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                   deadlines: Sequence[float] = ()) -> asyncio.Future[BatchOutcome]:
        return asyncio.ensure_future(self.run(parts, traceparent, deadlines))

    def declare_hung(self, reason: str) -> None:
        self.hung.append(reason)
        self.alive = False
        self.release.set()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def run(test: Callable[[FakeClock], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test(FakeClock()))


def submit(s: ModelScheduler, value: float, deadline: float = FAR) -> asyncio.Future[Any]:
    inputs = {"x": np.full((1, 1), value, dtype=np.float32)}
    return s.submit(request_of(inputs, lane=NORMAL, deadline_at=deadline, request_id=f"r{value}"), 1)


# --- the budget ------------------------------------------------------------------------------

def test_a_configured_compute_timeout_wins() -> None:
    assert compute_budget_s(4, {4: 0.1}, 0.05, configured_ms=1500) == 1.5


def test_a_configured_compute_timeout_is_never_below_a_few_measured_latencies() -> None:
    # A budget the model cannot meet would declare every batch hung (issue 19.10).
    assert compute_budget_s(4, {4: 1.0}, 0.5, configured_ms=100) == pytest.approx(CONFIGURED_BUDGET_MIN_FACTOR * 1.0)
    assert compute_budget_s(4, {4: 0.1}, 2.0, configured_ms=100) == pytest.approx(CONFIGURED_BUDGET_MIN_FACTOR * 2.0)
    assert compute_budget_s(4, {}, None, configured_ms=100) == 0.1  # nothing measured: the setting as given


def test_the_budget_is_the_warm_up_latency_of_the_smallest_batch_that_holds_the_rows_times_the_factor() -> None:
    warmup = {1: 0.6, 2: 0.8, 4: 1.0}
    assert compute_budget_s(3, warmup) == pytest.approx(COMPUTE_BUDGET_FACTOR * 1.0)
    assert compute_budget_s(2, warmup) == pytest.approx(COMPUTE_BUDGET_FACTOR * 0.8)
    # beyond the largest warmed-up size it scales with the rows
    assert compute_budget_s(8, warmup) == pytest.approx(COMPUTE_BUDGET_FACTOR * 2.0)


def test_the_budget_never_falls_below_the_floor() -> None:
    assert compute_budget_s(1, {1: 0.001}) == COMPUTE_BUDGET_FLOOR_S


def test_a_larger_learned_latency_raises_the_budget() -> None:
    assert compute_budget_s(4, {4: 1.0}, learned_latency_s=3.0) == pytest.approx(COMPUTE_BUDGET_FACTOR * 3.0)
    assert compute_budget_s(4, {4: 1.0}, learned_latency_s=0.1) == pytest.approx(COMPUTE_BUDGET_FACTOR * 1.0)


def test_without_measurements_the_budget_is_generous() -> None:
    assert compute_budget_s(4, {}) == UNMEASURED_COMPUTE_BUDGET_S


def test_the_scheduler_bases_its_budget_on_the_slowest_instance_s_warm_up() -> None:
    s = ModelScheduler(config(), clock=FakeClock())
    s.limits.observe_warmup(((1, 0.2), (2, 0.4), (4, 0.9)))
    s.limits.observe_warmup(((1, 0.1), (2, 0.5), (4, 0.8)))  # a second instance
    assert s.limits.compute_budget_s(2) == pytest.approx(COMPUTE_BUDGET_FACTOR * 0.5)
    assert s.limits.compute_budget_s(4) == pytest.approx(COMPUTE_BUDGET_FACTOR * 0.9)


# --- a running batch -------------------------------------------------------------------------

def test_requests_of_a_running_batch_are_answered_at_their_deadlines() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        runner = StuckRunner()
        s.add_runner(runner)
        first = submit(s, 1, deadline=clock.now() + 2)
        await settle()
        assert runner.batches == 1  # running, and it will not finish by itself
        clock.advance(1.999)
        await settle()
        assert not first.done()
        clock.advance(0.001)
        await settle()
        assert first.done() and isinstance(first.exception(), DeadlineExceeded)
        assert "while its batch was running" in str(first.exception())
        assert runner.hung == []  # a client's deadline never declares a worker hung
        runner.release.set()  # the batch finally finishes: its late answer is dropped, counted once
        await settle()
        assert s.stats.expired == 1 and s.running_rows == 0
    run(main)


def test_a_batch_over_its_compute_budget_gets_its_runner_declared_hung() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(compute_timeout_ms=5000), clock=clock)
        runner = StuckRunner()
        s.add_runner(runner)
        requests = [submit(s, 1, deadline=clock.now() + 60)]
        await settle()
        clock.advance(4.9)
        await settle()
        assert runner.hung == [] and not requests[0].done()
        clock.advance(0.1)
        await settle()
        assert len(runner.hung) == 1 and "over its compute budget of 5.0 s" in runner.hung[0]
        error = requests[0].exception()
        assert isinstance(error, WorkerHung) and error.status == 503 and error.code == "worker_hung"
        await settle()
        assert s.running_rows == 0  # the killed runner's batch is over
        queued = submit(s, 2, deadline=clock.now() + 60)  # nothing runs it (the only runner is gone) ...
        await settle()
        assert not queued.done() and runner.batches == 1
        fresh = StuckRunner()  # ... until a replacement is ready
        fresh.release.set()
        s.add_runner(fresh)
        assert (await queued).outputs["y"][0, 0] == 4
    run(main)


def test_short_client_deadlines_expire_requests_but_the_budget_decides_hangs() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        s.limits.observe_warmup(((1, 0.01),))  # budget: the 10 s floor
        runner = StuckRunner()
        s.add_runner(runner)
        doomed = [submit(s, v, deadline=clock.now() + 0.05) for v in range(3)]
        await settle()
        clock.advance(0.05)
        await settle()
        assert all(isinstance(f.exception(), DeadlineExceeded) for f in doomed)
        clock.advance(9.9)
        await settle()
        assert runner.hung == []
        clock.advance(0.1)
        await settle()
        assert len(runner.hung) == 1  # the batch itself ran past 10 s
    run(main)


def test_a_finished_batch_leaves_no_timer_behind() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(compute_timeout_ms=5000), clock=clock)
        runner = StuckRunner()
        runner.release.set()
        s.add_runner(runner)
        result = await submit(s, 3, deadline=clock.now() + 2)
        assert result.outputs["y"][0, 0] == 6
        await settle()
        assert clock.pending() == []
    run(main)


def test_fail_all_with_running_answers_requests_whose_batch_is_running() -> None:
    async def main(clock: FakeClock) -> None:
        from servewell.errors import ShuttingDown

        s = ModelScheduler(config(), clock=clock)
        runner = StuckRunner()
        s.add_runner(runner)
        running = submit(s, 1)
        await settle()
        queued = submit(s, 2)
        s.fail_all(ShuttingDown("drain timeout"), running=True)
        await settle()
        assert isinstance(running.exception(), ShuttingDown) and isinstance(queued.exception(), ShuttingDown)
        runner.release.set()
        await settle()
    run(main)
