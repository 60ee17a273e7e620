"""The scheduler with fake in-process runners and a manual clock: every exit path resolves every
future, and every timing rule holds without a single sleep."""

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
from servewell.engine.protocol import RequestResult
from servewell.engine.scheduler import ModelScheduler
from servewell.errors import DeadlineExceeded, InvalidInput, ModelError, Overloaded, ShuttingDown, WorkerLost
from servewell.observability.batch_telemetry import BatchTelemetry
from servewell.observability.context import BatchPlacement, placement_var
from servewell.observability.metrics import ServeMetrics, batch_size_bucket
from servewell.workers.expiry import keep_rows, plan_rows

HIGH, NORMAL = 0, 1  # lane indices of the default lanes ["high", "normal"]


def config(instances: int = 1, max_batch_size: int = 4, **batching: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": max_batch_size,
        "instances": instances,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
        "batching": batching,
    })


class FakeRunner:
    """Doubles its input; a batch finishes when the test releases it."""

    def __init__(self, fail_with: Exception | None = None, now: Callable[[], float] | None = None) -> None:
        self.alive = True
        self.instance = 0
        self.batches: list[list[float]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail_with = fail_with
        self.now = now  # given: skip requests whose deadline passed, as a worker does (workers/expiry.py)

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                   deadlines: Sequence[float] = ()) -> asyncio.Future[BatchOutcome]:
        return asyncio.ensure_future(self.run(parts, traceparent, deadlines))

    def declare_hung(self, reason: str) -> None:
        self.alive = False

    async def run(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                  deadlines: Sequence[float] = ()) -> BatchOutcome:
        if self.now is None:
            x = np.concatenate(parts["x"])
            self.batches.append(x[:, 0].tolist())
            await self.release.wait()
            skipped: tuple[int, ...] = ()
        else:
            await self.release.wait()
            rows = [block.shape[0] for block in parts["x"]]
            plan = plan_rows(rows, deadlines, self.now())
            if not plan.runs:
                return BatchOutcome({}, 0.0, skipped=plan.skipped)
            x = keep_rows({"x": np.concatenate(parts["x"])}, rows, plan)["x"]
            self.batches.append(x[:, 0].tolist())
            skipped = plan.skipped
        if self.fail_with is not None:
            self.alive = not isinstance(self.fail_with, WorkerLost)
            raise self.fail_with
        return BatchOutcome({"y": x * 2}, compute_s=0.001, skipped=skipped)


def row(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 2), value, dtype=np.float32)}


def submit(s: ModelScheduler, value: float, lane: int = NORMAL, deadline: float = FAR,
           rows: int = 1) -> asyncio.Future[RequestResult]:
    return s.submit(request_of(row(value, rows), lane=lane, deadline_at=deadline, request_id=f"r{value}"), rows)


async def settle() -> None:
    """Let every ready task and callback run."""
    for _ in range(10):
        await asyncio.sleep(0)


def held_runner(clock: FakeClock) -> tuple[ModelScheduler, FakeRunner]:
    """A scheduler of `config()` with one runner whose batches wait until the test releases them."""
    s = ModelScheduler(config(), clock=clock)
    runner = FakeRunner()
    runner.release.clear()
    s.add_runner(runner)
    return s, runner


def run(test: Callable[[FakeClock], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test(FakeClock()))


class HandOverRecorder(FakeRunner):
    """Records each batch the moment it is handed over (`send_batch`), not when a task runs it;
    refuses at once, as a handle whose worker just died does, while `gone` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[list[float]] = []
        self.gone = False

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                   deadlines: Sequence[float] = ()) -> asyncio.Future[BatchOutcome]:
        if self.gone:
            raise WorkerLost("the worker process is not running")
        self.handed.append(np.concatenate(parts["x"])[:, 0].tolist())
        return super().send_batch(parts, traceparent, deadlines)


def test_a_batch_is_handed_to_an_idle_runner_before_submit_returns() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        runner = HandOverRecorder()
        s.add_runner(runner)
        future = submit(s, 5)
        assert runner.handed == [[5]]  # on its way before any task or loop iteration ran
        assert (await future).outputs["y"][0, 0] == 10
    run(main)


def test_coalesced_requests_of_one_loop_step_form_one_batch_on_a_free_runner() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        runner = HandOverRecorder()
        s.add_runner(runner)
        coalesced = [s.submit(request_of(row(v), lane=NORMAL, request_id=f"c{v}"), 1, coalesce=True)
                     for v in (1, 2, 3)]
        assert runner.handed == []  # nothing handed over before this loop step ends
        await asyncio.gather(*coalesced)
        assert runner.handed == [[1, 2, 3]]
        one_by_one = [submit(s, v) for v in (4, 5, 6)]  # the default: the first goes at once, alone
        await asyncio.gather(*one_by_one)
        assert runner.handed == [[1, 2, 3], [4], [5, 6]]
    run(main)


def test_a_runner_refusing_the_hand_over_answers_the_batch_and_the_next_one_runs() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        runner = HandOverRecorder()
        runner.gone = True
        s.add_runner(runner)
        refused = submit(s, 1)
        with pytest.raises(WorkerLost, match="not running"):
            await refused
        runner.gone = False
        assert (await submit(s, 2)).outputs["y"][0, 0] == 4  # the runner was released, nothing hangs
    run(main)


def test_each_request_gets_its_own_rows_back() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        first = submit(s, 1)  # starts at once on the idle runner
        rest = [submit(s, v) for v in (2, 3)]
        await settle()
        runner.release.set()
        results = await asyncio.gather(first, *rest)
        assert [r.outputs["y"][0, 0] for r in results] == [2, 4, 6]
        assert runner.batches == [[1], [2, 3]]
        assert results[1].batch_size == 2
    run(main)


def test_each_request_learns_its_batch_instance_and_queue_position() -> None:
    async def main(clock: FakeClock) -> None:
        metrics = ServeMetrics()
        s = ModelScheduler(config(), BatchTelemetry("m", "1", ["high", "normal"], metrics), clock=clock)
        runner = FakeRunner()
        runner.instance = 3
        runner.release.clear()
        s.add_runner(runner)
        placements = [BatchPlacement() for _ in range(4)]
        futures = []
        for value, placement in enumerate(placements, start=1):
            token = placement_var.set(placement)  # what the middleware does for each request
            futures.append(submit(s, value))
            placement_var.reset(token)
        await settle()
        runner.release.set()
        await asyncio.gather(*futures)
        assert runner.batches == [[1], [2, 3, 4]]
        first, *rest = placements
        assert (first.batch_size, first.instance, first.queue_position) == (1, 3, 0)
        assert [p.queue_position for p in rest] == [0, 1, 2]  # requests already waiting in the lane
        assert {p.batch_id for p in rest} == {rest[0].batch_id} and rest[0].batch_id != first.batch_id
        assert {(p.batch_size, p.instance) for p in rest} == {(3, 3)}
        assert rest[0].facts() == {"batch_id": rest[0].batch_id, "batch_size": 3, "instance": 3, "queue_position": 0}
        by_size = {values[1]: sum(counts) for values, counts, _ in metrics.compute_by_size.snapshot()}
        assert by_size == {"1": 1, "4": 1}  # a batch of 3 counts under the next power of two
    run(main)


@pytest.mark.parametrize(("rows", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (64, 64), (65, 128)])
def test_batch_size_buckets_are_powers_of_two(rows: int, bucket: int) -> None:
    assert batch_size_bucket(rows) == bucket


def test_urgent_request_overtakes_a_full_normal_queue() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        running = submit(s, 0)
        queued = [submit(s, v) for v in range(1, 9)]
        urgent = submit(s, 99, lane=HIGH)
        await settle()
        runner.release.set()
        await asyncio.gather(running, urgent, *queued)
        assert runner.batches[1][0] == 99  # next batch after the running one is led by the urgent request
    run(main)


def test_window_policy_waits_for_a_fuller_batch_but_high_lane_does_not() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(policy="window", max_wait_ms=50), clock=clock)
        runner = FakeRunner()
        s.add_runner(runner)
        a, b = submit(s, 1), submit(s, 2)
        await settle()
        assert runner.batches == [] and clock.pending() == [pytest.approx(clock.now() + 0.05)]
        clock.advance(0.049)
        await settle()
        assert runner.batches == []  # the window is still open
        clock.advance(0.001)
        await asyncio.gather(a, b)
        assert runner.batches == [[1, 2]]
        urgent = submit(s, 3, lane=HIGH)
        await settle()
        assert urgent.done() and runner.batches[-1] == [3]  # no window, no clock movement
    run(main)


def test_window_closes_early_when_the_batch_is_full() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(policy="window", max_wait_ms=5000), clock=clock)
        runner = FakeRunner()
        s.add_runner(runner)
        futures = [submit(s, v) for v in range(4)]
        await settle()
        assert all(f.done() for f in futures) and runner.batches == [[0, 1, 2, 3]]
    run(main)


def test_expired_request_is_answered_at_its_deadline_and_never_reaches_the_model() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        busy = submit(s, 0)
        doomed = submit(s, 1, deadline=clock.now() + 0.02)
        clock.advance(0.019)
        await settle()
        assert not doomed.done()
        clock.advance(0.001)  # the timer at the deadline fires while the runner is still busy
        await settle()
        assert isinstance(doomed.exception(), DeadlineExceeded)
        runner.release.set()
        await busy
        assert runner.batches == [[0]]
    run(main)


def test_requests_sharing_the_next_deadline_arm_one_timer_and_a_fired_timer_is_armed_again() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        busy = submit(s, 0)
        await settle()  # the running batch's own watch is armed (its budget, far off)
        watch = clock.pending()
        armed: list[float] = []
        call_at = clock.call_at

        def counted(when: float, callback: Callable[[], None]) -> Any:
            armed.append(when)
            return call_at(when, callback)

        clock.call_at = counted  # type: ignore[method-assign]
        first = [submit(s, 1 + i, deadline=clock.now() + 0.02) for i in range(5)]
        assert sorted(clock.pending()) == sorted([*watch, clock.now() + 0.02])  # one wake-up, not one per request
        later = submit(s, 9, deadline=clock.now() + 0.05)
        assert sorted(clock.pending()) == sorted([*watch, clock.now() + 0.02])  # the earliest deadline decides
        assert armed == [clock.now() + 0.02]  # six requests, one timer made (not cancelled and made again)
        clock.advance(0.02)
        await settle()
        assert all(isinstance(f.exception(), DeadlineExceeded) for f in first)
        assert sorted(clock.pending()) == sorted([*watch, clock.now() + 0.03])  # armed again, for the next one
        clock.advance(0.03)
        await settle()
        assert isinstance(later.exception(), DeadlineExceeded)
        runner.release.set()
        await busy
        assert runner.batches == [[0]]
    run(main)


def test_rows_whose_deadline_passed_in_transit_are_skipped_and_the_rest_get_their_own_rows() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_batch_size=8, policy="window", max_wait_ms=10), clock=clock)
        runner = FakeRunner(now=clock.now)
        runner.release.clear()
        s.add_runner(runner)
        far = clock.now() + 60
        requests = [submit(s, 1, deadline=far, rows=2), submit(s, 2, deadline=clock.now() + 0.5),
                    submit(s, 3, deadline=far, rows=3)]
        clock.advance(0.01)  # the window closes: one batch of the three is handed to the runner
        await settle()
        clock.advance(1.0)  # ... which has not started when the middle one's deadline passes
        await settle()
        runner.release.set()
        first, doomed, last = await asyncio.gather(*requests, return_exceptions=True)
        assert isinstance(doomed, DeadlineExceeded)
        assert runner.batches == [[1, 1, 3, 3, 3]]  # its row never reached the model
        assert isinstance(first, RequestResult) and isinstance(last, RequestResult)
        assert first.outputs["y"][:, 0].tolist() == [2, 2] and last.outputs["y"][:, 0].tolist() == [6, 6, 6]
        assert s.stats.expired == 1  # answered once (at its deadline), counted once
        assert first.batch_size == 5
    run(main)


def test_a_runner_that_skips_what_the_engine_has_not_expired_yet_answers_deadline_exceeded() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_batch_size=8, policy="window", max_wait_ms=10), clock=clock)
        s.add_runner(FakeRunner(now=lambda: clock.now() + 1.0))  # its reading is ahead of the engine's timers
        both = [submit(s, 1, deadline=clock.now() + 0.5), submit(s, 2, deadline=clock.now() + 0.6)]
        clock.advance(0.01)
        results = await asyncio.gather(*both, return_exceptions=True)
        assert all(isinstance(r, DeadlineExceeded) and "it was not run" in str(r) for r in results)
        assert s.stats.expired == 2 and s.stats.batches == 0  # nothing ran: no batch is counted
    run(main)


def test_cancelled_request_is_dropped_before_compute() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        busy = submit(s, 0)
        gone = submit(s, 1)
        kept = submit(s, 2)
        gone.cancel()
        await settle()
        runner.release.set()
        await asyncio.gather(busy, kept)
        assert runner.batches == [[0], [2]]
        assert s.stats.cancelled == 1
    run(main)


def test_full_lane_is_refused_with_retry_after() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_queue_size=2), clock=clock)
        submit(s, 1), submit(s, 2)  # no runner yet: both stay queued
        with pytest.raises(Overloaded) as info:
            submit(s, 3)
        assert info.value.retry_after_s is not None and info.value.retry_after_s >= 1
        submit(s, 4, lane=HIGH)  # the high lane has its own bound
    run(main)


def test_runner_loss_fails_its_batch_and_model_errors_fail_theirs() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        s.add_runner(FakeRunner(fail_with=WorkerLost("gone")))
        with pytest.raises(WorkerLost):
            await submit(s, 1)
        s2 = ModelScheduler(config(), clock=clock)
        s2.add_runner(FakeRunner(fail_with=ModelError("boom")))
        with pytest.raises(ModelError):
            await submit(s2, 1)
    run(main)


def test_a_removed_runner_gets_no_more_batches() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(), clock=clock)
        old, new = FakeRunner(), FakeRunner()
        old.release.clear()
        s.add_runner(old)
        running = submit(s, 0)
        await settle()
        s.remove_runner(old)  # e.g. drained for memory: its batch still completes
        queued = submit(s, 1)
        old.release.set()
        await running
        await settle()
        assert not queued.done() and old.batches == [[0]]
        s.add_runner(new)
        await queued
        assert new.batches == [[1]]
    run(main)


def test_drain_finishes_queued_work_then_refuses_new_requests() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        pending = [submit(s, v) for v in range(6)]
        drained = asyncio.ensure_future(s.drain())
        await settle()
        with pytest.raises(ShuttingDown):
            submit(s, 7)
        runner.release.set()
        await drained
        assert all(p.done() and not p.exception() for p in pending)
    run(main)


def test_reserved_instance_serves_urgent_requests_while_the_other_is_busy() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(instances=2, reserve_instance_for_high=True), clock=clock)
        general, reserved = FakeRunner(), FakeRunner()
        general.release.clear()
        s.add_runner(general)
        s.add_runner(reserved)  # the second instance becomes the reserved one
        busy = submit(s, 0)
        queued = [submit(s, v) for v in range(1, 6)]
        urgent = await submit(s, 99, lane=HIGH)
        assert urgent.outputs["y"][0, 0] == 198
        assert reserved.batches == [[99]]  # normal work never ran on the reserved instance
        general.release.set()
        await asyncio.gather(busy, *queued)
        assert reserved.batches == [[99]]
    run(main)


def test_settings_change_while_serving_without_losing_requests() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(policy="window", max_wait_ms=10_000), clock=clock)
        runner = FakeRunner()
        s.add_runner(runner)
        waiting = [submit(s, v) for v in range(2)]  # held by the long window
        await settle()
        assert not any(w.done() for w in waiting)
        s.update({"policy": "idle", "max_batch_size": 2})
        results = await asyncio.gather(*waiting)
        assert [r.batch_size for r in results] == [2, 2]
        with pytest.raises(InvalidInput):
            s.update({"max_batch_size": 64})  # above what the model was loaded and warmed up with
        with pytest.raises(InvalidInput):
            s.update({"policy": "fastest"})
        assert s.limits.settings()["policy"] == "idle"
    run(main)


def test_an_update_with_one_bad_field_changes_nothing() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_batch_size=8), clock=clock)
        before = s.limits.settings()
        with pytest.raises(InvalidInput):
            s.update({"max_batch_size": 2, "max_wait_ms": -5})  # the size is valid, the wait is not
        with pytest.raises(InvalidInput):
            s.update({"max_batch_size": 2, "reserve_instance_for_high": True})  # needs instances >= 2
        with pytest.raises(InvalidInput):
            s.update({"max_batch_size": 2, "lanes": ["a"]})
        assert s.limits.settings() == before
        assert s.limits.max_batch_size == 8
    run(main)


def test_update_cannot_raise_the_batch_size_above_what_warm_up_proved() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_batch_size=16), clock=clock)
        s.limits.limit_max_batch_size(4, "warm-up measured memory")
        assert s.limits.max_batch_size == 4 and s.limits.proven_max_batch_size == 4
        with pytest.raises(InvalidInput, match="from 1 to 4"):
            s.update({"max_batch_size": 16})  # the configured size, which does not fit
        assert s.update({"max_batch_size": 2})["max_batch_size"] == 2
        s.limits.limit_max_batch_size(8, "a later, looser measurement")  # never raises the proven maximum
        assert s.limits.proven_max_batch_size == 4 and s.limits.max_batch_size == 2
    run(main)


def test_adaptive_policy_starts_at_once_at_low_load() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(policy="adaptive", max_wait_ms=500, latency_slo_ms=1000), clock=clock)
        runner = FakeRunner()
        s.add_runner(runner)
        for v in range(3):
            done = submit(s, v)
            await settle()
            assert done.done()  # no waiting at all: nothing else is arriving
            clock.advance(0.05)  # sparse arrivals
    run(main)


def test_admission_refuses_a_full_lane_before_any_decoding() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_queue_size=1), clock=clock)
        submit(s, 1)  # no runner: stays queued
        with pytest.raises(Overloaded):
            s.admit(NORMAL)
        s.admit(HIGH)  # another lane, its own bound
    run(main)


def test_a_request_that_would_finish_after_its_deadline_is_not_run() -> None:
    async def main(clock: FakeClock) -> None:
        s, runner = held_runner(clock)
        first = submit(s, -1)
        await settle()
        clock.advance(0.2)  # the scheduler learns that a batch takes about 200 ms
        runner.release.set()
        await first
        runner.batches.clear()
        runner.release.clear()
        busy = submit(s, 0, deadline=clock.now() + 5)
        doomed = submit(s, 1, deadline=clock.now() + 0.3)  # queued behind it
        await settle()
        clock.advance(0.2)  # busy's batch takes 200 ms too: 100 ms of doomed's budget are left
        runner.release.set()
        await busy
        await settle()
        assert clock.now() < 1000.2 + 0.3  # its deadline has not passed, but a 200 ms batch cannot fit
        assert isinstance(doomed.exception(), DeadlineExceeded)
        assert "would finish after its deadline" in str(doomed.exception())
        assert runner.batches == [[0]]
    run(main)


class PickyRunner(FakeRunner):
    """Fails any batch that holds a negative value, as a model with a bug on some inputs does."""

    async def run(self, parts: dict[str, list[np.ndarray]], traceparent: str | None = None,
                  deadlines: Sequence[float] = ()) -> BatchOutcome:
        x = np.concatenate(parts["x"])
        self.batches.append(x[:, 0].tolist())
        await self.release.wait()
        if (x < 0).any():
            raise ModelError("negative input")
        return BatchOutcome({"y": x * 2}, compute_s=0.001)


def test_one_bad_input_fails_only_its_own_request_not_its_batch_mates() -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_batch_size=4, policy="window", max_wait_ms=50), clock=clock)
        runner = PickyRunner()
        s.add_runner(runner)
        futures = [submit(s, v) for v in (1.0, -1.0, 3.0)]
        clock.advance(0.05)
        await settle()
        await asyncio.gather(*futures, return_exceptions=True)
        assert runner.batches == [[1.0, -1.0, 3.0], [1.0], [-1.0], [3.0]]  # the batch, then each alone
        assert futures[0].result().outputs["y"][0, 0] == 2.0 and futures[2].result().outputs["y"][0, 0] == 6.0
        assert isinstance(futures[1].exception(), ModelError)
        assert s.stats.isolated_batches == 1
    run(main)


@pytest.mark.parametrize(("error", "batches"), [
    (ModelError("broken"), [[1.0, 2.0], [1.0], [2.0]]),  # a model failing on everything: one retry each, never more
    (WorkerLost("gone"), [[1.0, 2.0]]),  # a lost worker: the batch fails, nothing is retried alone
])
def test_a_failed_batch_is_retried_alone_only_for_model_errors(error: Exception, batches: list[list[float]]) -> None:
    async def main(clock: FakeClock) -> None:
        s = ModelScheduler(config(max_batch_size=4, policy="window", max_wait_ms=50), clock=clock)
        runner = FakeRunner(fail_with=error)
        s.add_runner(runner)
        futures = [submit(s, v) for v in (1.0, 2.0)]
        clock.advance(0.05)
        await settle()
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, type(error)) for r in results)
        assert runner.batches == batches
    run(main)
