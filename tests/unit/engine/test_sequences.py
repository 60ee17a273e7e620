"""Continuous batching (engine/sequences.py) with a fake runner that answers each step when the test
says, and a manual clock: who joins and who leaves at each step, and every way a sequence ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from fake_clock import FakeClock
from inference_requests import FAR, request_of
from servewell.config.model import ModelConfig
from servewell.engine.protocol import RequestResult
from servewell.engine.sequences import SequenceScheduler
from servewell.engine.stream import PartBuffer, StreamPart
from servewell.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    Overloaded,
    ShuttingDown,
    StreamTooSlow,
    WorkerHung,
    WorkerLost,
)
from servewell.workers.messages import SequenceJoin, SequencePart, StepDone, StepFailed

HIGH, NORMAL = 0, 1


def config(**generate: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "g", "runtime": "python", "artifact": "g.py", "python": {"entry": "g:G"}, "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "UINT8", "shape": [-1]}],
        "generate": generate,
    })


class StepRunner:
    """Records the changes it is sent (joins and leaves, as a worker applies them before its next
    step); the test makes it step with `answer`, its parts going to the scheduler's listener."""

    def __init__(self) -> None:
        self.alive = True
        self.instance = 0
        self.steps: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (joined ids, leaving ids) per message
        self.running: list[int] = []  # what the worker would hold
        self.limits: dict[int, int] = {}  # parts each may still make (the worker ends it with its last)
        self.listener: Callable[[StepDone | StepFailed], None] | None = None
        self.hung: str | None = None

    def send_step(self, joins: tuple[SequenceJoin, ...], leaves: tuple[int, ...]) -> None:
        self.steps.append((tuple(j.seq_id for j in joins), leaves))
        self.running = [i for i in self.running if i not in leaves] + [j.seq_id for j in joins]
        self.limits.update({j.seq_id: j.limit for j in joins if j.limit})

    def listen_to_steps(self, listener: Callable[[StepDone | StepFailed], None]) -> None:
        self.listener = listener

    def declare_hung(self, reason: str) -> None:
        self.hung, self.alive = reason, False

    def answer(self, done: tuple[int, ...] = (), fail: dict[int, str] | None = None) -> None:
        """One step: every running sequence makes one part ('.'); `done` ones finish with theirs."""
        parts = []
        ended = set(done) | set(fail or {})
        for seq_id in self.running:
            error = (fail or {}).get(seq_id)
            left = self.limits.get(seq_id)
            if left is not None:
                self.limits[seq_id] = left - 1
                if left <= 1:
                    ended.add(seq_id)
            parts.append(SequencePart(seq_id, None if error else {"y": np.frombuffer(b".", np.uint8)[None, :]},
                                      seq_id in ended, error))
        self.running = [i for i in self.running if i not in ended]
        assert self.listener is not None
        self.listener(StepDone(len(self.steps), tuple(parts), 0.001))

    def fail_step(self, message: str) -> None:
        self.running = []
        assert self.listener is not None
        self.listener(StepFailed(len(self.steps), message))


def run(test: Callable[[FakeClock], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test(FakeClock()))


def req(lane: int = NORMAL, tenant: str = "", deadline_at: float = FAR, max_outputs: int = 0, prompt: bytes = b"p"):
    return request_of({"x": np.frombuffer(prompt, np.uint8)[None, :]}, model="g", lane=lane, tenant=tenant,
                      deadline_at=deadline_at)._replace(max_outputs=max_outputs)


async def turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_sequences_join_the_running_batch_without_waiting_for_it() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        first = scheduler.submit(req(), 1)
        await turn()
        assert runner.steps == [((1,), ())]
        runner.answer()
        second = scheduler.submit(req(), 1)  # the first runs: the second joins before the next step
        await turn()
        assert runner.steps[-1] == ((2,), ())
        runner.answer(done=(1,))
        result = await first
        assert bytes(result.outputs["y"].reshape(-1)) == b".."  # its two parts, joined along the open axis
        assert not second.done()
        runner.answer(done=(2,))
        assert (await second).outputs["y"].shape == (1, 2)
    run(body)


def test_static_batching_lets_nobody_join_while_a_sequence_runs() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(batching="static"), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        scheduler.submit(req(), 1)
        await turn()
        later = scheduler.submit(req(), 1)
        await turn()
        assert runner.steps == [((1,), ())]  # the second did not join the running batch
        runner.answer()
        await turn()
        assert len(runner.steps) == 1
        runner.answer(done=(1,))
        await turn()
        assert runner.steps[-1] == ((2,), ())  # the batch emptied: now it joins
        runner.answer(done=(2,))
        assert later.done()
    run(body)


def test_running_sequences_are_bounded_by_max_sequences() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_sequences=2, urgent_sequences=0), clock)
        runner = StepRunner()
        for _ in range(4):
            scheduler.submit(req(), 1)
        scheduler.add_runner(runner)
        await turn()
        assert runner.steps == [((1, 2), ())]
        assert (scheduler.stats().running, scheduler.stats().waiting) == (2, 2)
        runner.answer(done=(1,))
        await turn()
        assert runner.steps[-1] == ((3,), ())  # one place freed, one joined
    run(body)


def test_an_urgent_sequence_joins_at_the_next_step_however_many_others_run() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_sequences=4), clock)  # 1 place of 4 kept for the first lane
        runner = StepRunner()
        for _ in range(5):
            scheduler.submit(req(NORMAL), 1)
        scheduler.add_runner(runner)
        await turn()
        assert runner.steps == [((1, 2, 3), ())]  # the normal lane fills three places
        runner.answer()
        urgent = scheduler.submit(req(HIGH), 1)
        await turn()
        assert runner.steps[-1] == ((6,), ())  # the urgent one, not the waiting normal ones
        runner.answer(done=(6,))
        assert urgent.done() and urgent.exception() is None
    run(body)


def test_tenants_share_the_running_places_by_weight() -> None:
    async def body(clock: FakeClock) -> None:
        weights = {"heavy": 3.0, "light": 1.0}
        scheduler = SequenceScheduler(config(max_sequences=4, urgent_sequences=0), clock, weights.__getitem__)
        runner = StepRunner()
        for _ in range(6):  # the light tenant asks first, and more
            scheduler.submit(req(tenant="light"), 1)
        for _ in range(6):
            scheduler.submit(req(tenant="heavy"), 1)
        scheduler.add_runner(runner)
        await turn()
        joined = runner.steps[-1][0]
        tenants = ["light" if i <= 6 else "heavy" for i in joined]
        assert sorted(tenants) == ["heavy", "heavy", "heavy", "light"]  # 3:1 of the four places
        runner.answer(done=tuple(i for i in joined if i <= 6))  # the light one leaves: light takes its place
        await turn()
        assert [("light" if i <= 6 else "heavy") for i in runner.steps[-1][0]] == ["light"]
    run(body)


def test_a_deadline_ends_a_running_stream_and_frees_it_at_the_next_step() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        outcome = scheduler.submit(req(deadline_at=clock.now() + 0.001), 1)
        await turn()
        runner.answer()
        clock.advance(0.002)
        assert isinstance(outcome.exception(), DeadlineExceeded)  # answered when it passed
        await turn()
        assert runner.steps[-1][1] == (1,)  # the worker ends it before its next step
        assert scheduler.stats().running == 0 and scheduler.stats().expired == 1
    run(body)


def test_a_deadline_that_passes_while_waiting_answers_at_once() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)  # no runner yet: it waits
        outcome = scheduler.submit(req(deadline_at=clock.now() + 0.001), 1)
        clock.advance(0.002)
        assert isinstance(outcome.exception(), DeadlineExceeded)
        assert scheduler.stats().waiting == 0
    run(body)


def test_a_cancelled_stream_is_freed_at_the_next_step() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        outcome = scheduler.submit(req(), 1)
        other = scheduler.submit(req(), 1)
        await turn()
        runner.answer()
        outcome.cancel()  # the client disconnected
        await turn()
        assert runner.steps[-1] == ((), (1,)) and 1 not in runner.running
        assert not other.done() and scheduler.stats().cancelled == 1
    run(body)


def test_many_leaves_at_once_are_one_message() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        outcomes = [scheduler.submit(req(), 1) for _ in range(5)]
        await turn()
        for outcome in outcomes[:4]:
            outcome.cancel()
        await turn()
        assert runner.steps[-1] == ((), (1, 2, 3, 4))
    run(body)


def test_a_slow_reader_ends_its_stream_with_stream_too_slow() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        buffer = PartBuffer(2)
        outcome = scheduler.submit(req(), 1, buffer)
        buffer.attach(outcome)
        await turn()
        for _ in range(3):  # nobody reads: the third part finds the buffer full
            runner.answer()
        await turn()
        assert outcome.cancelled()
        assert runner.steps[-1][1] == (1,)
        parts = []
        with pytest.raises(StreamTooSlow):
            async for part in buffer:
                parts.append(part)
        assert len(parts) == 2  # what was buffered is still read
    run(body)


def test_a_request_gets_at_most_its_max_outputs() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_outputs=5), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        outcome = scheduler.submit(req(max_outputs=2), 1)
        unbounded = scheduler.submit(req(), 1)
        await turn()
        assert runner.limits == {1: 2, 2: 5}  # the worker ends each with its last part
        runner.answer()
        runner.answer()
        result: RequestResult = await outcome
        assert result.outputs["y"].shape == (1, 2) and not unbounded.done()
    run(body)


def test_a_model_error_ends_only_its_sequence() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        bad, good = scheduler.submit(req(), 1), scheduler.submit(req(), 1)
        await turn()
        runner.answer(fail={1: "ValueError: no"})
        assert isinstance(bad.exception(), ModelError) and "no" in str(bad.exception())
        runner.answer(done=(2,))
        assert good.exception() is None
    run(body)


def test_a_failed_step_ends_every_sequence_of_its_worker() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        first, second = scheduler.submit(req(), 1), scheduler.submit(req(), 1)
        await turn()
        runner.fail_step("ValueError: step broke")
        assert all(isinstance(o.exception(), ModelError) for o in (first, second))
        assert scheduler.stats().running == 0
    run(body)


def test_a_lost_worker_fails_its_running_sequences_and_others_wait_for_the_next() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_sequences=1, urgent_sequences=0), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        running, waiting = scheduler.submit(req(), 1), scheduler.submit(req(), 1)
        await turn()
        scheduler.remove_runner(runner)
        assert isinstance(running.exception(), WorkerLost) and not waiting.done()
        replacement = StepRunner()
        scheduler.add_runner(replacement)
        await turn()
        assert replacement.steps == [((2,), ())]
    run(body)


def test_refusals_before_queueing() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_waiting=1, max_state_bytes=4), clock)
        with pytest.raises(InvalidInput, match="max_state_bytes"):
            scheduler.submit(req(prompt=b"too long"), 1)
        scheduler.submit(req(), 1)
        with pytest.raises(Overloaded, match="max_waiting"):
            scheduler.submit(req(), 1)
        scheduler.submit(req(HIGH), 1)  # the urgent lane waits beside the full normal one
    run(body)


def test_drain_waits_for_every_sequence() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        outcome = scheduler.submit(req(), 1)
        draining = asyncio.ensure_future(scheduler.drain())
        await turn()
        assert not draining.done()
        runner.answer(done=(1,))
        await turn()
        assert draining.done() and outcome.done()
    run(body)


def test_part_buffer_gives_parts_in_order_then_ends_with_the_outcome() -> None:
    async def body(clock: FakeClock) -> None:
        buffer = PartBuffer(4)
        outcome: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        buffer.attach(outcome)
        for i in range(3):
            assert buffer.put(StreamPart({"y": np.array([i])}, i, 0.0))
        outcome.set_result(RequestResult({}, 0.0, 0.0, 1))
        assert [part.index async for part in buffer] == [0, 1, 2]
    run(body)


def test_the_inputs_one_message_carries_to_the_worker_are_bounded() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_state_bytes=100_000), clock)
        runner = StepRunner()
        for _ in range(3):
            scheduler.submit(req(prompt=b"p" * 90_000), 1)  # two would be 180 KB in one message: over 128 KiB
        scheduler.add_runner(runner)
        await turn()
        assert runner.steps == [((1,), ())]
        runner.answer()
        await turn()
        assert runner.steps[-1] == ((2,), ())  # the next one joins with the next message
    run(body)


def test_a_worker_that_stops_stepping_is_replaced() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(step_timeout_ms=1000), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        outcome = scheduler.submit(req(), 1)
        await turn()
        clock.advance(0.9)
        runner.answer()  # it steps: the watch counts from here
        clock.advance(0.9)
        assert runner.hung is None
        clock.advance(0.2)
        assert runner.hung is not None and "step_timeout_ms" in runner.hung
        assert isinstance(outcome.exception(), WorkerHung)
    run(body)


def test_waiting_sequences_are_the_models_queue_depth() -> None:
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(), clock)
        scheduler.submit(req(HIGH), 1)
        scheduler.submit(req(NORMAL), 1)
        scheduler.submit(req(NORMAL), 1)
        assert scheduler.lane_depths() == {"high": 1, "normal": 2}
    run(body)


def test_fail_all_answers_every_waiting_and_running_sequence() -> None:
    """The model going away ends every sequence with its error, the waiting ones of several tenants
    included (ending one while walking the waiting room must not upset the walk)."""
    async def body(clock: FakeClock) -> None:
        scheduler = SequenceScheduler(config(max_sequences=1, urgent_sequences=0), clock)
        runner = StepRunner()
        scheduler.add_runner(runner)
        running = scheduler.submit(req(tenant="a"), 1)
        await turn()
        waiting = [scheduler.submit(req(tenant=t), 1) for t in ("a", "b", "b", "c")]
        await turn()
        assert scheduler.stats().waiting == 4 and scheduler.stats().running == 1
        scheduler.fail_all(ShuttingDown("going away"))
        for outcome in (running, *waiting):
            with pytest.raises(ShuttingDown):
                await outcome
        assert scheduler.stats().waiting == 0 and scheduler.stats().running == 0
        assert scheduler.lane_depths() == {"high": 0, "normal": 0} and scheduler.tenant_depth("b") == 0
    run(body)
