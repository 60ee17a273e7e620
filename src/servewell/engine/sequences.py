"""Continuous (iteration-level) batching: a generative model's sequences, step by step.

A generative model (a `generate:` section in model.yaml) answers each request in parts. Its
requests come here from the admission chain's last stage, as any request reaches its model's
scheduler, and each becomes one *sequence*. Each instance (a worker) runs a loop of steps: when a
step's parts come back, the next step is planned and sent at once:

1. **leave**: the sequences that must stop before the next step are named to the worker: those
   whose client went away (the outcome future was cancelled), whose deadline passed (answered 503
   `deadline_exceeded`), whose reader is too slow (408 `stream_too_slow`) or that reached their
   most parts (`max_outputs`, or the request's own `max_outputs`);
2. **join**: waiting sequences take the free places, up to `generate.max_sequences` running per
   instance (`batching: static` lets them join only when none runs: the classic batcher, kept as
   the baseline). The first lane goes first and has `urgent_sequences` places the other lanes
   cannot take, so an urgent sequence joins at the next step however busy the model is; within a
   lane the tenant with the fewest running sequences per unit of weight goes next (tenants share
   the steps by their weights), then the one waiting longest;
3. **step**: every running sequence makes its next part; each part goes to its sequence's
   `PartSink` (engine/stream.py) at once, and a sequence that is done answers its outcome future
   with the whole answer (what a non-streamed request, the payload log and the canary judge see).

Every future is resolved on every path: done, failed (the model's error for that sequence; a
failed step fails the sequences it ran), deadline, cancel, a worker lost (503 `worker_lost`),
`fail_all`, `drain`. No polling: one timer per sequence (its deadline) and the steps' replies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from servewell.config.generate import MAX_STATE_BYTES, GenerateSettings
from servewell.config.model import ModelConfig
from servewell.engine.clock import Clock, LoopClock, TimerHandle
from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.stream import PartSink, StreamPart, whole_answer
from servewell.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    Overloaded,
    ServeError,
    ShuttingDown,
    StreamTooSlow,
    WorkerHung,
    WorkerLost,
)
from servewell.workers.messages import SequenceJoin, StepDone

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

    def send_step(self, joins: tuple[SequenceJoin, ...], leaves: tuple[int, ...]) -> asyncio.Future[StepDone]:
        """Hand over one step now; the future gives its parts (or fails with a `ServeError`)."""
        ...

    def declare_hung(self, reason: str) -> None:
        """Its step overran `generate.step_timeout_ms`: stop it now (its pool replaces it); the step
        in flight then fails."""
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

    __slots__ = ("runner", "running", "leaving", "busy", "watch")

    def __init__(self, runner: SequenceRunner) -> None:
        self.runner = runner
        self.running: dict[int, _Sequence] = {}
        self.leaving: list[int] = []  # told to the worker with the next step
        self.busy = False
        self.watch: TimerHandle | None = None  # the step in flight's time limit


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
        self._weight_of = weight_of or (lambda tenant: 1.0)
        self._telemetry: StreamTelemetry = telemetry or _NoTelemetry()
        self._waiting: list[dict[str, deque[_Sequence]]] = [{} for _ in self.lanes]  # lane -> tenant -> queue
        self._waiting_count = 0
        self._loops: list[_RunnerLoop] = []
        self._running_by_tenant: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._accepting = True
        self._drained: asyncio.Event | None = None
        self._open_axes = {spec.name: next((i for i, n in enumerate(spec.shape) if n == -1), None)
                           for spec in config.outputs}
        self._counts = dict.fromkeys(("started", "finished", "expired", "cancelled", "too_slow", "failed", "steps",
                                      "parts"), 0)

    # --- what others read ----------------------------------------------------------------------

    @property
    def urgent_sequences(self) -> int:
        """Places of each instance's `max_sequences` only the first lane may take."""
        if len(self.lanes) < 2:
            return 0
        reserved = self.settings.urgent_sequences
        if reserved is None:
            reserved = max(1, self.settings.max_sequences // 8)
        return min(reserved, self.settings.max_sequences - 1)

    def stats(self) -> SequenceStats:
        """Running and waiting sequences, and the counts since the model loaded."""
        return SequenceStats(sum(len(loop.running) for loop in self._loops), self._waiting_count, **self._counts)

    def lane_depths(self) -> dict[str, int]:
        """Sequences waiting to join, per lane (the model's `servewell_queue_depth`)."""
        return {name: sum(len(queue) for queue in self._waiting[i].values()) for i, name in enumerate(self.lanes)}

    def tenant_depth(self, tenant: str) -> int:
        """Sequences of `tenant` waiting to join (the tenant's per-model queue quota counts them)."""
        return sum(len(lane.get(tenant, ())) for lane in self._waiting)

    # --- runners -----------------------------------------------------------------------------

    def add_runner(self, runner: SequenceRunner) -> None:
        """A ready instance may run steps."""
        if any(loop.runner is runner for loop in self._loops):
            return
        self._loops.append(_RunnerLoop(runner))
        self._kick()

    def remove_runner(self, runner: SequenceRunner) -> None:
        """Give `runner` no more steps; its step in flight still answers (or fails) its sequences."""
        loop = next((loop for loop in self._loops if loop.runner is runner), None)
        if loop is None:
            return
        self._loops.remove(loop)
        if not loop.busy:
            for seq in list(loop.running.values()):
                self._end(seq, WorkerLost(f"model '{self.config.name}' lost the worker running this sequence; safe to "
                                          "retry"))

    # --- requests ----------------------------------------------------------------------------

    def submit(self, request: InferenceRequest, rows: int,
               sink: PartSink | None = None) -> asyncio.Future[RequestResult]:
        """Queue `request` as one sequence; the future resolves when it ends (the whole answer, or
        the error that ended it); its parts go to `sink` as they are made."""
        if not self._accepting:
            raise ShuttingDown(f"model '{self.config.name}' is draining and takes no new sequences")
        lane = request.lane if 0 <= request.lane < len(self.lanes) else len(self.lanes) - 1
        waiting = sum(len(queue) for queue in self._waiting[lane].values())
        if waiting >= self.settings.max_waiting:  # per lane: a flood of one lane never shuts out another
            raise Overloaded(f"model '{self.config.name}' has {waiting} sequences waiting to join in lane "
                             f"'{self.lanes[lane]}', its generate.max_waiting", tenant=request.tenant)
        size = _input_bytes(request)
        if size > self.settings.max_state_bytes:
            raise InvalidInput(f"the request's inputs hold {size} bytes; a sequence of model '{self.config.name}' "
                               f"starts from at most {self.settings.max_state_bytes} (generate.max_state_bytes)")
        limit = self.settings.max_outputs
        if request.max_outputs > 0:
            limit = min(limit, request.max_outputs)
        outcome: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        seq = _Sequence(next(self._ids), request._replace(lane=lane), sink, outcome, limit, self._clock.now())
        self._waiting[lane].setdefault(request.tenant, deque()).append(seq)
        self._waiting_count += 1
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
        for lane in self._waiting:
            for queue in lane.values():
                for seq in list(queue):
                    self._end(seq, error)
        for loop in self._loops:
            for seq in list(loop.running.values()):
                self._end(seq, error)

    # --- the step loop -----------------------------------------------------------------------

    def _kick(self) -> None:
        for loop in list(self._loops):
            if not loop.busy and loop.runner.alive:
                self._send_step(loop)

    def _send_step(self, loop: _RunnerLoop) -> None:
        joins = self._joins(loop)
        leaves = tuple(loop.leaving)
        if not joins and not loop.running and not leaves:
            return
        loop.leaving = []
        messages = tuple(SequenceJoin(seq.id, dict(seq.request.inputs)) for seq in joins)
        try:
            future = loop.runner.send_step(messages, leaves)
        except ServeError as error:  # the worker is gone (its pool replaces it), or the step could not be sent
            for seq in list(loop.running.values()):
                self._end(seq, error)
            loop.leaving = []  # a worker that did not get the step still holds them: a new worker holds none
            if not loop.runner.alive and loop in self._loops:
                self._loops.remove(loop)
            return
        loop.busy = True
        self._counts["steps"] += 1
        loop.watch = self._clock.call_at(self._clock.now() + self.settings.step_timeout_ms / 1000.0,
                                         lambda: self._overran(loop, future))
        future.add_done_callback(lambda done: self._stepped(loop, done))

    def _overran(self, loop: _RunnerLoop, future: asyncio.Future[StepDone]) -> None:
        """A step that never ends (the model's code hangs) holds every sequence of its instance: the
        worker is declared hung and replaced, its sequences answered `worker_hung`."""
        if future.done():
            return
        log.error("model %s: a step ran longer than generate.step_timeout_ms (%g ms); its worker is replaced",
                  self.config.name, self.settings.step_timeout_ms, extra={"model": self.config.name})
        loop.runner.declare_hung(f"a step ran longer than generate.step_timeout_ms ({self.settings.step_timeout_ms:g}"
                                 " ms)")
        if not future.done():  # a runner that does not fail it itself
            future.set_exception(WorkerHung(f"model '{self.config.name}''s step overran generate.step_timeout_ms; "
                                            "its worker was replaced"))

    def _joins(self, loop: _RunnerLoop) -> list[_Sequence]:
        free = self.settings.max_sequences - len(loop.running)
        if free <= 0 or self._waiting_count == 0:
            return []
        if self.settings.batching == "static" and loop.running:
            return []
        now = self._clock.now()
        joins: list[_Sequence] = []
        urgent = self.urgent_sequences
        carried = 0  # bytes of inputs this step's message carries (bounded: it crosses the pipe whole)
        for lane, tenants in enumerate(self._waiting):
            room = free - len(joins) - (urgent if lane > 0 else 0)
            while room > 0 and tenants:
                head = self._peek(tenants)
                size = _input_bytes(head.request)
                if joins and carried + size > MAX_STATE_BYTES:
                    return joins  # the rest join at the next step
                carried += size
                seq = self._next_of(tenants)
                self._waiting_count -= 1
                if seq.outcome.done():
                    continue
                seq.joined_at, seq.runner = now, loop
                seq.batch_size = len(loop.running) + 1
                loop.running[seq.id] = seq
                tenant = seq.request.tenant
                self._running_by_tenant[tenant] = self._running_by_tenant.get(tenant, 0) + 1
                self._counts["started"] += 1
                joins.append(seq)
                room -= 1
        return joins

    def _tenant_next(self, tenants: dict[str, deque[_Sequence]]) -> str:
        """Whose sequence of one lane joins next: the tenant with the fewest running sequences per
        unit of weight, then the one whose head waited longest."""
        def share(tenant: str) -> tuple[float, float]:
            weight = max(self._weight_of(tenant), 1e-9)
            return (self._running_by_tenant.get(tenant, 0) / weight, tenants[tenant][0].enqueued_at)

        return min(tenants, key=share)

    def _peek(self, tenants: dict[str, deque[_Sequence]]) -> _Sequence:
        return tenants[self._tenant_next(tenants)][0]

    def _next_of(self, tenants: dict[str, deque[_Sequence]]) -> _Sequence:
        """The next sequence of one lane (`_tenant_next`), taken out of its queue."""
        tenant = self._tenant_next(tenants)
        queue = tenants[tenant]
        seq = queue.popleft()
        if not queue:
            del tenants[tenant]
        return seq

    def _stepped(self, loop: _RunnerLoop, future: asyncio.Future[StepDone]) -> None:
        loop.busy = False
        if loop.watch is not None:
            loop.watch.cancel()
            loop.watch = None
        if future.cancelled():
            error: ServeError = WorkerLost("the step was cancelled")
        else:
            raised = future.exception()
            if raised is None:
                self._deliver(loop, future.result())
                if loop in self._loops and loop.runner.alive:
                    self._send_step(loop)
                self._maybe_drained()
                return
            error = raised if isinstance(raised, ServeError) else ModelError(f"the step failed: {raised}")
        for seq in list(loop.running.values()):
            self._end(seq, error)
        loop.leaving = []
        self._kick()
        self._maybe_drained()

    def _deliver(self, loop: _RunnerLoop, done: StepDone) -> None:
        now = self._clock.now()
        running = len(loop.running)
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
            if part.done:
                loop.running.pop(seq.id, None)
                self._end(seq, None)
            elif seq.count >= seq.limit:
                self._end(seq, None)  # its most parts: done (finish_reason length); the worker is told to end it

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
            lane = self._waiting[seq.request.lane]
            queue = lane.get(seq.request.tenant)
            if queue is not None and seq in queue:
                queue.remove(seq)
                self._waiting_count -= 1
                if not queue:
                    del lane[seq.request.tenant]
        else:
            tenant = seq.request.tenant
            self._running_by_tenant[tenant] = self._running_by_tenant.get(tenant, 1) - 1
            if not self._running_by_tenant[tenant]:
                del self._running_by_tenant[tenant]
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
        return self._waiting_count > 0 or any(loop.running or loop.busy for loop in self._loops)

    def _maybe_drained(self) -> None:
        if self._drained is not None and not self._busy():
            self._drained.set()


def _input_bytes(request: InferenceRequest) -> int:
    return sum(int(np.asarray(array).nbytes) for array in request.inputs.values())
