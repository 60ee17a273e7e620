"""The pipe to one running worker process: batches and steps out, their outcomes back.

`WorkerHandle` owns the process (spawn or adopt a spare, load, heartbeat, hang, exit, stop);
this owns what crosses its pipe once it runs: each batch's rows written into the worker's input
arena and announced (`RunBatch`), its outputs read back from the worker's segment (large ones
copied off the event loop), a generative model's step changes and steps, and a profile's start
and stop. They change for different reasons: the wire protocol with the worker's messages, the
lifecycle with how processes are started and supervised.

The event loop watches the pipe's file descriptor (`add_reader`): it reads replies when they
arrive, never polls, and learns of a worker's death (pipe EOF) the moment it happens. No reader
thread, so no GIL hand-offs between a thread and the loop on every batch. A message about the
process itself (load progress, ready, load failed) goes to the handle's `on_lifecycle`; the pipe's
end to its `on_closed`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection

import numpy as np

from servewell.engine.batch_runner import BatchOutcome
from servewell.errors import ModelError, ServeError, WorkerLost
from servewell.workers.messages import (
    BatchDone,
    BatchFailed,
    ProfileDone,
    RunBatch,
    SequenceChanges,
    SequenceJoin,
    StartProfile,
    StepDone,
    StepFailed,
    StopProfile,
    WorkerMessage,
    receive_message,
    send_message,
)
from servewell.workers.shm import COPIES, OFF_LOOP_BYTES, SegmentReader, SharedArena, copies_of

#: How long a profile's start or stop waits for the worker's answer.
PROFILE_REPLY_TIMEOUT_S = 60.0


class WorkerChannel:
    """One worker's pipe and shared-memory segments, from the frontend's side."""

    def __init__(self, arena: SharedArena, on_lifecycle: Callable[[WorkerMessage], None],
                 on_closed: Callable[[], None], on_done: Callable[[BatchDone | StepDone], None]) -> None:
        self._arena: SharedArena | None = arena
        self._on_lifecycle = on_lifecycle
        self._on_closed = on_closed
        self._on_done = on_done
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[BatchOutcome]] = {}
        self._reader = SegmentReader()
        self._copies: set[asyncio.Future[dict[str, np.ndarray]]] = set()  # large outputs being copied out
        #: Where a generative model's steps go as the worker makes them (`listen_to_steps`).
        self._step_listener: Callable[[StepDone | StepFailed], None] | None = None
        self._profile_reply: asyncio.Future[ProfileDone] | None = None

    @property
    def open(self) -> bool:
        """Whether the pipe is attached and not closed."""
        return self._conn is not None and not self._conn.closed

    def attach(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading the worker's end of `conn` on `loop`."""
        self._conn, self._loop = conn, loop
        loop.add_reader(conn.fileno(), self._on_readable)

    def send(self, message: WorkerMessage) -> None:
        """Write one message to the worker; `OSError` or `ValueError` when its pipe is gone."""
        if self._conn is None:
            raise ValueError("the pipe is not attached")
        send_message(self._conn, message)

    def send_batch(self, parts: dict[str, list[np.ndarray]], traceparent: str | None,
                   deadlines: Sequence[float], arena_prefix: str) -> asyncio.Future[BatchOutcome]:
        """Write the batch made of the row blocks in `parts` (concatenated along axis 0) into the
        input arena and announce it; the future resolves with its outcome. `OSError` or `ValueError`
        when the pipe is gone (nothing is left waiting then)."""
        if self._arena is None:
            self._arena = SharedArena(prefix=arena_prefix)
        shapes = {}
        for name, blocks in parts.items():
            rows = sum(b.shape[0] for b in blocks)
            shapes[name] = ((rows, *blocks[0].shape[1:]), blocks[0].dtype)
        views = self._arena.views(shapes)
        for name, blocks in parts.items():
            start = 0
            for block in blocks:
                views[name][start : start + block.shape[0]] = block
                start += block.shape[0]
        refs = self._arena.refs_of(views)
        del views  # the arena may need to grow next time; hold no views into it
        batch_id = next(self._ids)
        future: asyncio.Future[BatchOutcome] = asyncio.get_running_loop().create_future()
        self._pending[batch_id] = future
        try:
            first = next(iter(parts.values()), [])
            self.send(RunBatch(batch_id, self._arena.name, refs, traceparent,
                               tuple(b.shape[0] if b.ndim else 1 for b in first), tuple(deadlines)))
        except (OSError, ValueError):
            self._pending.pop(batch_id, None)
            raise
        return future

    def send_step(self, joins: tuple[SequenceJoin, ...], leaves: tuple[int, ...]) -> None:
        """Tell a generative model's worker which sequences join and which leave before its next step."""
        self.send(SequenceChanges(joins, leaves))

    def listen_to_steps(self, listener: Callable[[StepDone | StepFailed], None]) -> None:
        """Give each step the worker makes (its parts, or the failure that ended its sequences) to `listener`."""
        self._step_listener = listener

    async def profile(self, seconds: float, directory: str) -> str:
        """Profile the worker's batches for `seconds`; the path of the Chrome trace file."""
        await self._profile_step(StartProfile(directory))
        await asyncio.sleep(seconds)
        reply = await self._profile_step(StopProfile())
        if reply.path is None:
            raise ModelError("profiling produced no trace file")
        return reply.path

    async def _profile_step(self, message: StartProfile | StopProfile) -> ProfileDone:
        if not self.open:
            raise WorkerLost("the worker process is not running")
        reply: asyncio.Future[ProfileDone] = asyncio.get_running_loop().create_future()
        self._profile_reply = reply
        self.send(message)
        done = await asyncio.wait_for(reply, timeout=PROFILE_REPLY_TIMEOUT_S)
        if done.error:
            raise ModelError(f"profiling failed: {done.error}")
        return done

    def fail_waiting(self, error: ServeError) -> None:
        """Answer every batch waiting on the worker with `error`, and a profile waiting with
        `WorkerLost` (a generative model's sequences are ended by its pool's `worker_gone`)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        if self._profile_reply is not None and not self._profile_reply.done():
            self._profile_reply.set_exception(WorkerLost(str(error)))

    def close(self) -> None:
        """Stop reading and close the pipe (the worker exits on its EOF)."""
        if self._conn is not None and self._loop is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()

    def release(self) -> None:
        """Unmap the segments this side holds (the handle removes every segment of the worker by name)."""
        self._reader.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            # Messages are small and written whole, so a readable pipe holds a whole message. One
            # per call: the loop's readiness is level-triggered, so a second one calls again, and
            # the `poll` that asked first cost more than the read (a selector built per call).
            if conn is not None and not conn.closed:
                self._dispatch(receive_message(conn))
        except (EOFError, OSError):
            self.close()
            self._on_closed()

    def _dispatch(self, message: WorkerMessage) -> None:
        if isinstance(message, BatchDone):
            future = self._pending.pop(message.batch_id, None)
            if future is not None and not future.done():
                if sum(ref.nbytes for ref in message.outputs) >= OFF_LOOP_BYTES:
                    self._deliver_off_loop(future, message)
                else:
                    outputs = self._reader.arrays(message.segment, message.outputs, copy=True) \
                        if message.outputs else {}
                    future.set_result(BatchOutcome(outputs, message.compute_s, message.steps, message.skipped))
            self._on_done(message)  # after: it may replace the worker (its memory limit)
        elif isinstance(message, BatchFailed):
            future = self._pending.pop(message.batch_id, None)
            if future is not None and not future.done():
                future.set_exception(_batch_error(message))
        elif isinstance(message, (StepDone, StepFailed)):
            if isinstance(message, StepDone):
                self._on_done(message)
            if self._step_listener is not None:
                self._step_listener(message)
        elif isinstance(message, ProfileDone):
            if self._profile_reply is not None and not self._profile_reply.done():
                self._profile_reply.set_result(message)
        else:
            self._on_lifecycle(message)

    def _deliver_off_loop(self, future: asyncio.Future[BatchOutcome], done: BatchDone) -> None:
        """Copy a large batch's outputs out of the worker's arena on the copy thread, then resolve
        `future`: the worker writes its arena again only for a batch sent after that (the runner
        is busy until the future resolves), and the event loop serves meanwhile (issue 45 H1)."""
        views = self._reader.arrays(done.segment, done.outputs, copy=False)
        copying = asyncio.ensure_future(COPIES.run(partial(copies_of, views)))
        self._copies.add(copying)

        def delivered(task: asyncio.Future[dict[str, np.ndarray]]) -> None:
            self._copies.discard(task)
            if future.done():
                return
            if task.cancelled() or task.exception() is not None:
                future.set_exception(WorkerLost(f"the batch's outputs could not be read: {task!r}"))
            else:
                future.set_result(BatchOutcome(task.result(), done.compute_s, done.steps, done.skipped))

        copying.add_done_callback(delivered)


def _batch_error(failed: BatchFailed) -> ServeError:
    """What the requests of a batch the worker could not answer get."""
    if failed.refusal is not None:  # not the model raising: an answer too large, /dev/shm full
        return failed.refusal
    if failed.fatal:
        return WorkerLost(f"the device failed and the worker restarts: {failed.message}")
    return ModelError(f"model failed on the batch: {failed.message}")
