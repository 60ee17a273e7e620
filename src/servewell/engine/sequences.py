"""Continuous (iteration-level) batching: a generative model's sequences, step by step.

A generative model (a `generate:` section in model.yaml) answers each request in parts. Its
requests come here from the admission chain's last stage, as any request reaches its model's
scheduler, and each becomes one *sequence*. Each instance (a worker) steps on its own while any
of its sequences runs (workers/process_main.py `SequenceStepper`), and applies the changes this
scheduler sends it before each step (`SequenceChanges`, sent at most once per event-loop turn):

1. **leave**: the sequences that must stop: those whose client went away (the outcome future was
   cancelled), whose deadline passed (answered 503 `deadline_exceeded`), whose reader is too slow
   (408 `stream_too_slow`); one that reaches its most parts (`max_outputs`, or the request's own)
   is ended by the worker with its last part;
2. **join**: waiting sequences take the free places, up to `generate.max_sequences` running per
   instance (`batching: static` lets them join only when none runs: the classic batcher, kept as
   the baseline), in the order of the waiting room (engine/sequence_queue.py: urgent places for
   the first lane, tenants by their weights, the bytes one step carries);
3. **parts**: each step's parts come back as the worker makes them (`StepDone`); each goes to its
   sequence's `PartSink` (engine/stream.py) at once, and a sequence that is done answers its
   outcome future with the whole answer (what a non-streamed request, the payload log and the
   canary judge see). A part never waits for the engine: the time between parts is the model's
   step plus the worker's own bookkeeping (issue 48's goal: + 0.3 ms at most).

Every future is resolved on every path: done, failed (the model's error for that sequence; a
failed step fails the sequences it ran), deadline, cancel, a worker lost (503 `worker_lost`) or
hung (no step for `step_timeout_ms`: 503 `worker_hung`), `fail_all`, `drain`. No polling: one
timer per sequence (its deadline), one per instance (its step watch) and the steps themselves.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from servewell.config.generate import GenerateSettings
from servewell.config.model import ModelConfig
from servewell.engine.clock import Clock, LoopClock, TimerHandle
from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.sequence_queue import SequenceQueue, input_bytes
from servewell.engine.stream import PartSink, StreamPart, whole_answer
from servewell.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    ServeError,
    ShuttingDown,
    StreamTooSlow,
    WorkerHung,
    WorkerLost,
)
from servewell.workers.messages import SequenceJoin, StepDone, StepFailed

log = logging.getLogger("servewell.engine")


class SequenceRunner(Protocol):
    """Runs a generative model's steps (a worker process: `workers/handle.py`, or a test fake)."""

    @property
    def instance(self) -> int:
        """Which instance of the model it is (0-based)."""
        ...

    @property
    def alive(self) -> bool:
        """Whether it can still run steps."""
        ...

    def send_step(self, joins: tuple[SequenceJoin, ...], leaves: tuple[int, ...]) -> None:
        """Send the changes to apply before its next step now (a `ServeError` when it is gone)."""
        ...

    def listen_to_steps(self, listener: Callable[[StepDone | StepFailed], None]) -> None:
        """Give each step it makes to `listener`."""
        ...

    def declare_hung(self, reason: str) -> None:
        """No step for `generate.step_timeout_ms` while sequences ran: stop it now (its pool replaces it)."""
        ...


class StreamTelemetry(Protocol):
    """What a sequence's parts are measured by (observability/stream_telemetry.py)."""

    def first_output(self, model: str, seconds: float) -> None:
        """Time from a request's arrival to its first part."""
        ...

    def between_outputs(self, model: str, seconds: float) -> None:
        """Time between two parts of one sequence."""
        ...

    def step(self, model: str, running: int, compute_s: float) -> None:
        """One step ran `running` sequences in `compute_s` seconds of the worker's time."""
        ...

    def ended(self, model: str, reason: str) -> None:
        """A sequence ended: finished, cancelled, deadline_exceeded, stream_too_slow or failed."""
        ...


class _NoTelemetry:
    def first_output(self, model: str, seconds: float) -> None:
        """Not measured."""

    def between_outputs(self, model: str, seconds: float) -> None:
        """Not measured."""

    def step(self, model: str, running: int, compute_s: float) -> None:
        """Not measured."""

    def ended(self, model: str, reason: str) -> None:
        """Not measured."""


@dataclass(slots=True, eq=False)
class _Sequence:
    """One request of a generative model, from `submit` to its end."""

    id: int
    request: InferenceRequest
    sink: PartSink | None
    outcome: asyncio.Future[RequestResult]
    limit: int  # most parts
    enqueued_at: float
    timer: TimerHandle | None = None
    joined_at: float | None = None
    runner: _RunnerLoop | None = None
    parts: list[dict[str, np.ndarray]] = field(default_factory=list)
    count: int = 0
    last_at: float | None = None
    compute_s: float = 0.0
    batch_size: int = 0
    ended: bool = False


@dataclass(slots=True, frozen=True)
class SequenceStats:
    """A generative model's sequences now, and since it loaded."""

    running: int
    waiting: int
    started: int
    finished: int
    expired: int
    cancelled: int
    too_slow: int
    failed: int
    steps: int
    parts: int


class _RunnerLoop:
    """One instance's running sequences and its step in flight."""

    __slots__ = ("runner", "running", "leaving", "flushing", "heard_at", "watch")

    def __init__(self, runner: SequenceRunner) -> None:
        self.runner = runner
        self.running: dict[int, _Sequence] = {}  # joined (sent) and not ended
        self.leaving: list[int] = []  # told to the worker with the next changes
        self.flushing = False  # changes are to be sent at the end of this event-loop turn
        self.heard_at = 0.0  # when it last stepped (or was given its first sequence)
        self.watch: TimerHandle | None = None  # its step watch, while sequences run


class SequenceScheduler:
    """Queues a generative model's sequences and runs them on its instances, one step at a time."""

    def __init__(self, config: ModelConfig, clock: Clock | None = None,
                 weight_of: Callable[[str], float] | None = None, telemetry: StreamTelemetry | None = None) -> None:
        if config.generate is None:
            raise ValueError(f"model '{config.name}' has no generate: section")
        self.config = config
        self.settings: GenerateSettings = config.generate
        self.lanes: tuple[str, ...] = tuple(config.batching.lanes)
        self._clock: Clock = clock or LoopClock()
        self._telemetry: StreamTelemetry = telemetry or _NoTelemetry()
        self._queue: SequenceQueue[_Sequence] = SequenceQueue(config.name, self.lanes, self.settings, weight_of)
        self._loops: list[_RunnerLoop] = []
        self._ids = itertools.count(1)
        self._accepting = True
        self._drained: asyncio.Event | None = None
        self._open_axes = {spec.name: next((i for i, n in enumerate(spec.shape) if n == -1), None)
                           for spec in config.outputs}
        self._counts = dict.fromkeys(("started", "finished", "expired", "cancelled", "too_slow", "failed", "steps",
                                      "parts"), 0)

    # --- what others read ----------------------------------------------------------------------

    def stats(self) -> SequenceStats:
        """Running and waiting sequences, and the counts since the model loaded."""
        return SequenceStats(sum(len(loop.running) for loop in self._loops), self._queue.count, **self._counts)

    def lane_depths(self) -> dict[str, int]:
        """Sequences waiting to join, per lane (the model's `servewell_queue_depth`)."""
        return self._queue.lane_depths()

    def tenant_depth(self, tenant: str) -> int:
        """Sequences of `tenant` waiting to join (the tenant's per-model queue quota counts them)."""
        return self._queue.tenant_depth(tenant)

    # --- runners -----------------------------------------------------------------------------

    def add_runner(self, runner: SequenceRunner) -> None:
        """A ready instance may run steps."""
        if any(loop.runner is runner for loop in self._loops):
            return
        loop = _RunnerLoop(runner)
        self._loops.append(loop)
        runner.listen_to_steps(lambda message: self._stepped(loop, message))
        self._kick()

    def remove_runner(self, runner: SequenceRunner) -> None:
        """Give `runner` no more steps; its step in flight still answers (or fails) its sequences."""
        loop = next((loop for loop in self._loops if loop.runner is runner), None)
        if loop is None:
            return
        self._loops.remove(loop)
        self._lost(loop, WorkerLost(f"model '{self.config.name}' lost the worker running this sequence; safe to "
                                    "retry"))

    # --- requests ----------------------------------------------------------------------------

    def submit(self, request: InferenceRequest, rows: int,
               sink: PartSink | None = None) -> asyncio.Future[RequestResult]:
        """Queue `request` as one sequence; the future resolves when it ends (the whole answer, or
        the error that ended it); its parts go to `sink` as they are made."""
        if not self._accepting:
            raise ShuttingDown(f"model '{self.config.name}' is draining and takes no new sequences")
        lane = self._queue.lane_of(request)
        self._queue.check_room(lane, request.tenant)
        size = input_bytes(request)
        if size > self.settings.max_state_bytes:
            raise InvalidInput(f"the request's inputs hold {size} bytes; a sequence of model '{self.config.name}' "
                               f"starts from at most {self.settings.max_state_bytes} (generate.max_state_bytes)")
        limit = self.settings.max_outputs
        if request.max_outputs > 0:
            limit = min(limit, request.max_outputs)
        outcome: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        seq = _Sequence(next(self._ids), request._replace(lane=lane), sink, outcome, limit, self._clock.now())
        self._queue.add(seq)
        seq.timer = self._clock.call_at(request.deadline_at, lambda: self._expire(seq))
        outcome.add_done_callback(lambda future: self._left(seq) if future.cancelled() else None)
        self._kick()
        return outcome

    async def drain(self) -> None:
        """Take no new sequence; wait until every queued and running one has ended."""
        self._accepting = False
        if self._busy():
            self._drained = asyncio.Event()
            await self._drained.wait()

    def fail_all(self, error: ServeError) -> None:
        """End every waiting and running sequence with `error` (the model is going away)."""
        for seq in self._queue.waiting():
            self._end(seq, error)
        for loop in self._loops:
            for seq in list(loop.running.values()):
                self._end(seq, error)

    # --- the step loop -----------------------------------------------------------------------

    def _kick(self) -> None:
        for loop in self._loops:
            self._flush_soon(loop)

    def _flush_soon(self, loop: _RunnerLoop) -> None:
        """Send `loop`'s changes at the end of this event-loop turn: a burst of leaves (500 clients
        gone at once) or of joins is one message."""
        if not loop.flushing:
            loop.flushing = True
            asyncio.get_running_loop().call_soon(self._flush, loop)

    def _flush(self, loop: _RunnerLoop) -> None:
        loop.flushing = False
        if loop not in self._loops or not loop.runner.alive:
            return
        was_idle = not loop.running
        joins = self._joins(loop)
        leaves = tuple(loop.leaving)
        if not joins and not leaves:
            return
        loop.leaving = []
        messages = tuple(SequenceJoin(seq.id, dict(seq.request.inputs), seq.limit) for seq in joins)
        try:
            loop.runner.send_step(messages, leaves)
        except ServeError as error:  # the worker is gone (its pool replaces it), or the changes could not be sent
            self._lost(loop, error)
            if not loop.runner.alive and loop in self._loops:
                self._loops.remove(loop)
            return
        if was_idle and loop.running:
            loop.heard_at = self._clock.now()
        self._watch(loop)

    def _watch(self, loop: _RunnerLoop) -> None:
        """Arm `loop`'s step watch while it runs sequences (`_overdue`)."""
        if loop.watch is None and loop.running:
            loop.watch = self._clock.call_at(loop.heard_at + self.settings.step_timeout_ms / 1000.0,
                                             lambda: self._overdue(loop))

    def _overdue(self, loop: _RunnerLoop) -> None:
        """No step came for `step_timeout_ms` while sequences ran (the model's code hangs): the worker
        is declared hung and replaced, its sequences answered `worker_hung`."""
        loop.watch = None
        if not loop.running or loop not in self._loops:
            return
        if self._clock.now() - loop.heard_at < self.settings.step_timeout_ms / 1000.0:
            self._watch(loop)  # it stepped since: watch from its last step
            return
        log.error("model %s: no step for %g ms (generate.step_timeout_ms); its worker is replaced",
                  self.config.name, self.settings.step_timeout_ms, extra={"model": self.config.name})
        loop.runner.declare_hung(f"no step for {self.settings.step_timeout_ms:g} ms (generate.step_timeout_ms)")
        self._lost(loop, WorkerHung(f"model '{self.config.name}''s worker made no step for "
                                    f"{self.settings.step_timeout_ms:g} ms; it was replaced"))

    def _lost(self, loop: _RunnerLoop, error: ServeError) -> None:
        """Every sequence `loop` runs ends with `error` (its worker no longer holds them)."""
        for seq in list(loop.running.values()):
            loop.running.pop(seq.id, None)
            self._end(seq, error)
        loop.leaving = []
        if loop.watch is not None:
            loop.watch.cancel()
            loop.watch = None
        self._kick()
        self._maybe_drained()

    def _joins(self, loop: _RunnerLoop) -> list[_Sequence]:
        """The waiting sequences that join `loop`'s running batch now (its free places)."""
        if self.settings.batching == "static" and loop.running:
            return []
        joins = self._queue.next_joins(self.settings.max_sequences - len(loop.running))
        now = self._clock.now()
        for seq in joins:
            seq.joined_at, seq.runner = now, loop
            seq.batch_size = len(loop.running) + 1
            loop.running[seq.id] = seq
        self._counts["started"] += len(joins)
        return joins

    def _stepped(self, loop: _RunnerLoop, message: StepDone | StepFailed) -> None:
        """A step the worker made (or the failure that ended its sequences)."""
        if loop not in self._loops:
            return  # a runner already given up: its sequences were answered
        loop.heard_at = self._clock.now()
        if isinstance(message, StepFailed):
            error = WorkerLost(f"the device failed and the worker restarts: {message.message}") if message.fatal \
                else ModelError(f"model '{self.config.name}' failed on the step: {message.message}")
            self._lost(loop, error)
            return
        self._counts["steps"] += 1
        self._deliver(loop, message)
        if loop.leaving or (self._queue.count and len(loop.running) < self.settings.max_sequences):
            self._flush_soon(loop)
        self._maybe_drained()

    def _deliver(self, loop: _RunnerLoop, done: StepDone) -> None:
        now = self._clock.now()
        running = len(done.parts)
        if done.compute_s:
            self._telemetry.step(self.config.name, running, done.compute_s)
        share = done.compute_s / running if running else 0.0
        for part in done.parts:
            seq = loop.running.get(part.seq_id)
            if seq is None or seq.ended:
                continue  # it left meanwhile (its leave goes with the next step)
            seq.compute_s += share
            if part.error is not None:
                loop.running.pop(seq.id, None)  # the worker ended it
                self._end(seq, ModelError(f"model '{self.config.name}' failed on this sequence: {part.error}"))
                continue
            if part.outputs is not None:
                self._part(seq, part.outputs, now)
                if seq.ended:
                    continue
            if part.done:  # the worker ended it (its model said done, or its last allowed part)
                loop.running.pop(seq.id, None)
                self._end(seq, None)
            elif seq.count >= seq.limit:
                self._end(seq, None)  # its most parts (finish_reason length); the worker is told to end it

    def _part(self, seq: _Sequence, outputs: dict[str, np.ndarray], now: float) -> None:
        index = seq.count
        seq.count += 1
        self._counts["parts"] += 1
        if seq.last_at is None:
            self._telemetry.first_output(self.config.name, now - seq.request.arrived_at)
        else:
            self._telemetry.between_outputs(self.config.name, now - seq.last_at)
        seq.last_at = now
        seq.parts.append(outputs)
        if seq.sink is not None and not seq.sink.put(StreamPart(outputs, index, now)):
            self._end(seq, StreamTooSlow(f"the client of model '{self.config.name}' read its stream too slowly; "
                                         "it was ended"))

    # --- endings -----------------------------------------------------------------------------

    def _expire(self, seq: _Sequence) -> None:
        if seq.ended:
            return
        where = "while it waited to join" if seq.runner is None else f"after {seq.count} parts"
        budget_ms = (seq.request.deadline_at - seq.request.arrived_at) * 1000
        self._end(seq, DeadlineExceeded(f"the stream's deadline of {budget_ms:.0f} ms passed {where}",
                                        tenant=seq.request.tenant))
        self._kick()

    def _left(self, seq: _Sequence) -> None:
        """The outcome was cancelled (the client went away, or its reader was too slow)."""
        if not seq.ended:
            self._end(seq, None)
            self._kick()

    def _end(self, seq: _Sequence, error: ServeError | None) -> None:
        """End `seq` once: out of the queue or the running set (its worker told at the next step
        unless the worker ended it), its timer cancelled, its future answered."""
        if seq.ended:
            return
        seq.ended = True
        if seq.timer is not None:
            seq.timer.cancel()
        loop = seq.runner
        if loop is None:
            self._queue.remove(seq)
        else:
            self._queue.stopped_running(seq.request.tenant)
            if loop.running.pop(seq.id, None) is not None:
                loop.leaving.append(seq.id)
        outcome = seq.outcome
        if error is not None:
            key = {"deadline_exceeded": "expired", "stream_too_slow": "too_slow"}.get(error.code, "failed")
            reason = error.code if key != "failed" else "failed"
            if not outcome.done():
                outcome.set_exception(error)
        elif outcome.cancelled():
            key = reason = "cancelled"
        else:
            key = reason = "finished"
            if not outcome.done():
                outcome.set_result(self._result(seq))
        self._counts[key] += 1
        self._telemetry.ended(self.config.name, reason)
        seq.parts = seq.parts if error is None else []
        self._maybe_drained()

    def _result(self, seq: _Sequence) -> RequestResult:
        joined = seq.joined_at if seq.joined_at is not None else seq.enqueued_at
        return RequestResult(whole_answer(seq.parts, self._open_axes), joined - seq.enqueued_at, seq.compute_s,
                             seq.batch_size)

    def _busy(self) -> bool:
        return self._queue.count > 0 or any(loop.running for loop in self._loops)

    def _maybe_drained(self) -> None:
        if self._drained is not None and not self._busy():
            self._drained.set()

