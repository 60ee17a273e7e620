"""A worker's pipe from the frontend's side (`WorkerChannel`), the worker played by this test on the
other end of a real pipe and real shared memory: a batch's rows reach the worker's arena as one
batch with each request's rows, its outputs come back; a failed batch gets the error that says why;
messages about the process go to the handle; the pipe's end is reported once and fails what waits."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from servewell.errors import ModelError, Overloaded, ServeError, WorkerLost
from servewell.workers.channel import WorkerChannel
from servewell.workers.messages import (
    BatchDone,
    BatchFailed,
    LoadProgress,
    RunBatch,
    StepDone,
    WorkerMessage,
    receive_message,
    send_message,
)
from servewell.workers.shm import SegmentReader, SharedArena, new_prefix, remove_segments


@dataclass
class Handle:
    """What the channel tells its handle."""

    lifecycle: list[WorkerMessage] = field(default_factory=list)
    done: list[BatchDone | StepDone] = field(default_factory=list)
    closed: int = 0

    def on_closed(self) -> None:
        self.closed += 1


@dataclass
class Wired:
    channel: WorkerChannel
    handle: Handle
    worker: Connection  # the worker's end of the pipe
    prefix: str


@asynccontextmanager
async def wiring() -> AsyncIterator[Wired]:
    prefix = new_prefix()
    handle = Handle()
    channel = WorkerChannel(SharedArena(prefix=f"{prefix}-in"), handle.lifecycle.append, handle.on_closed,
                            handle.done.append)
    ours, worker = multiprocessing.Pipe(duplex=True)
    channel.attach(ours, asyncio.get_running_loop())
    try:
        yield Wired(channel, handle, worker, prefix)
    finally:
        channel.close()
        channel.release()
        worker.close()
        remove_segments(prefix)


def run(scenario: Callable[[Wired], Awaitable[None]]) -> None:
    """`scenario` on a channel wired to this test's end of a pipe, on an event loop of its own."""
    async def wired_then_run() -> None:
        async with wiring() as wired:
            await scenario(wired)

    asyncio.run(wired_then_run())


async def worker_reads(conn: Connection) -> Any:
    """The next message the worker's end receives (the pipe is written before `send_batch` returns)."""
    assert await asyncio.to_thread(conn.poll, 5)
    return receive_message(conn)


async def until(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.005)


def test_a_batch_reaches_the_worker_whole_and_its_outputs_come_back() -> None:
    run(a_batch_round_trip)


async def a_batch_round_trip(wired: Wired) -> None:
    first, second = np.ones((1, 3), np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)
    future = wired.channel.send_batch({"x": [first, second]}, None, (1.0, 2.0), f"{wired.prefix}-in")
    run = await worker_reads(wired.worker)
    assert isinstance(run, RunBatch) and run.request_rows == (1, 2) and run.deadlines == (1.0, 2.0)
    reader = SegmentReader()
    try:
        rows = reader.arrays(run.segment, run.inputs, copy=True)["x"]
    finally:
        reader.close()
    np.testing.assert_array_equal(rows, np.concatenate([first, second]))
    outputs = SharedArena(prefix=f"{wired.prefix}-out")  # the worker's own arena
    try:
        refs = outputs.write({"y": rows * 2})
        send_message(wired.worker, BatchDone(run.batch_id, outputs.name, refs, 0.01, rss_bytes=123, rows_computed=3))
        outcome = await asyncio.wait_for(future, 5)
    finally:
        outputs.close()
    np.testing.assert_array_equal(outcome.outputs["y"], rows * 2)  # a copy: the worker's segment is gone
    assert outcome.compute_s == 0.01
    (done,) = wired.handle.done  # the handle hears of it too: the worker's memory and rows
    assert isinstance(done, BatchDone) and (done.rss_bytes, done.rows_computed) == (123, 3)


@pytest.mark.parametrize(("failed", "expected", "says"), [
    (BatchFailed(0, "boom"), ModelError, "model failed on the batch: boom"),
    (BatchFailed(0, "device lost", fatal=True), WorkerLost, "the device failed and the worker restarts"),
    (BatchFailed(0, "", refusal=Overloaded("too large an answer")), Overloaded, "too large an answer"),
])
def test_a_failed_batch_gets_the_error_that_says_why(failed: BatchFailed, expected: type[ServeError],
                                                    says: str) -> None:
    async def scenario(wired: Wired) -> None:
        await a_batch_failing(wired, failed, expected, says)

    run(scenario)


async def a_batch_failing(wired: Wired, failed: BatchFailed, expected: type[ServeError], says: str) -> None:
    future = wired.channel.send_batch({"x": [np.zeros((1, 1), np.float32)]}, None, (), f"{wired.prefix}-in")
    run = await worker_reads(wired.worker)
    send_message(wired.worker, BatchFailed(run.batch_id, failed.message, failed.fatal, failed.refusal))
    with pytest.raises(expected, match=says):
        await asyncio.wait_for(future, 5)
    assert wired.handle.done == []


def test_messages_about_the_process_go_to_the_handle() -> None:
    run(a_load_progress)


async def a_load_progress(wired: Wired) -> None:
    send_message(wired.worker, LoadProgress("read weights", 0.5))
    await until(lambda: wired.handle.lifecycle)
    assert wired.handle.lifecycle == [LoadProgress("read weights", 0.5)]


def test_the_pipes_end_is_reported_once_and_fails_what_waits() -> None:
    run(a_worker_dying)


async def a_worker_dying(wired: Wired) -> None:
    future = wired.channel.send_batch({"x": [np.zeros((1, 1), np.float32)]}, None, (), f"{wired.prefix}-in")
    await worker_reads(wired.worker)
    wired.worker.close()  # the worker died
    await until(lambda: wired.handle.closed)
    await asyncio.sleep(0.05)
    assert wired.handle.closed == 1 and not wired.channel.open
    assert not future.done()  # the handle decides what it was (exit code, hung) and says so
    wired.channel.fail_waiting(WorkerLost("worker process 1 exit code 9"))
    with pytest.raises(WorkerLost, match="exit code 9"):
        await future
    with pytest.raises((OSError, ValueError)):  # nothing is left waiting on a batch that was never sent
        wired.channel.send_batch({"x": [np.zeros((1, 1), np.float32)]}, None, (), f"{wired.prefix}-in")
    wired.channel.fail_waiting(WorkerLost("again"))  # nothing waits: a no-op
