"""A request's queue time is read on the precise clock (engine/clock.py `precise_time`): uvloop's
`loop.time()` counts whole milliseconds, so every queue time under a millisecond read 0.000 and
`Server-Timing` showed `queue;dur=0.000` or `1.000`; a test's clock is used as it is."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import uvloop

from fake_clock import FakeClock
from inference_requests import FAR, request_of
from servewell.config.model import ModelConfig
from servewell.engine.batch_runner import BatchOutcome
from servewell.engine.clock import LoopClock, precise_time
from servewell.engine.scheduler import ModelScheduler


def config() -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": 4, "instances": 1,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
    })


class Runner:
    alive = True
    instance = 0

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                   deadlines: object = ()) -> asyncio.Future[BatchOutcome]:
        future: asyncio.Future[BatchOutcome] = asyncio.get_running_loop().create_future()
        future.set_result(BatchOutcome({"y": np.concatenate(parts["x"]) * 2}, compute_s=0.001))
        return future

    def declare_hung(self, reason: str) -> None:
        self.alive = False


def test_the_loop_clock_reads_the_precise_monotonic_clock_and_a_test_clock_itself() -> None:
    assert precise_time(LoopClock()) is time.monotonic
    clock = FakeClock()
    assert precise_time(clock)() == clock.now()


def test_a_queue_time_under_a_millisecond_is_not_rounded_to_zero_under_uvloop() -> None:
    async def main() -> float:
        scheduler = ModelScheduler(config())
        scheduler.add_runner(Runner())
        x = {"x": np.ones((1, 2), dtype=np.float32)}
        result = await scheduler.submit(request_of(x, deadline_at=FAR, request_id="r"), 1)
        return result.queue_s

    loop = uvloop.new_event_loop()
    try:
        queue_s = loop.run_until_complete(main())
    finally:
        loop.close()
    assert 0.0 < queue_s < 0.001  # handed over in the same loop step: microseconds, not 0 or 1 ms


def test_a_test_clock_gives_exact_queue_times() -> None:
    async def main() -> float:
        clock = FakeClock()
        scheduler = ModelScheduler(config(), clock=clock)
        x = {"x": np.ones((1, 2), dtype=np.float32)}
        future = scheduler.submit(request_of(x, deadline_at=FAR, request_id="r"), 1)
        clock.advance(0.25)
        scheduler.add_runner(Runner())
        return (await future).queue_s

    assert asyncio.run(main()) == 0.25
