"""Per-model scheduler: admits requests into priority lanes and feeds free runners batches.

Event-driven: it acts when a request arrives, when a runner becomes free, and on one timer
(the earliest of "a batching wait ends" and "a queued deadline passes"; `PumpWakeups`). It never
polls. What it keeps of each request is in `scheduled.py`.
The rules themselves live in `BatchQueue` (ordering, lanes, bounds) and `batch_policy`
(when to start); this class only wires them to a clock and the runners. Time comes from an
injectable `Clock`, so every rule is unit-tested without sleeping.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from servewell.config.model import ModelConfig
from servewell.engine.batch_execution import BatchExecution
from servewell.engine.batch_limits import BatchLimits
from servewell.engine.batch_policy import POLICIES, BatchOpportunity, LearnedLoad, PolicyLimits
from servewell.engine.batch_queue import BatchQueue, QueuedItem
from servewell.engine.batch_runner import BatchRunner
from servewell.engine.clock import Clock, LoopClock, precise_time
from servewell.engine.full_lanes import FullLanes, Publish, lane_full
from servewell.engine.promised import Promise, PromisedPlaces
from servewell.engine.protocol import RequestResult
from servewell.engine.pump_wakeups import PumpWakeups
from servewell.engine.request import InferenceRequest
from servewell.engine.runner_roster import RunnerRoster
from servewell.engine.scheduled import PendingRequest, Request, SchedulerStats, fail
from servewell.errors import (
    DeadlineExceeded,
    InvalidInput,
    Overloaded,
    ServeError,
    ShuttingDown,
)
from servewell.observability.batch_telemetry import BatchTelemetry

log = logging.getLogger("servewell.engine")


class ModelScheduler:
    """Queues requests for one model and runs them in batches on its runners."""

    def __init__(self, config: ModelConfig, telemetry: BatchTelemetry | None = None,
                 clock: Clock | None = None, weight_of: Callable[[str], float] | None = None,
                 full_lanes: Publish | None = None) -> None:
        self.config = config
        self.lanes: tuple[str, ...] = tuple(config.batching.lanes)
        self._telemetry = telemetry or BatchTelemetry(config.name, config.version, self.lanes)
        self._clock: Clock = clock or LoopClock()
        self._precise = precise_time(self._clock)  # queue times in microseconds, not uvloop's whole ms
        self._learned = LearnedLoad()
        #: The live batching settings, the largest batch proven to fit, what a batch takes.
        self.limits = BatchLimits(config, self._learned)
        self._queue: BatchQueue[PendingRequest] = BatchQueue(
            len(self.lanes), config.batching.max_queue_size, config.batching.max_consecutive_high,
            **({"weight_of": weight_of} if weight_of is not None else {}),
        )
        self._runners: RunnerRoster[BatchRunner] = RunnerRoster()  # who may be handed a batch, and who is free
        self._wakeups = PumpWakeups(self._clock, self._pump)
        self._accepting = True
        self._drained: asyncio.Event | None = None
        #: The batches handed to runners and not yet ended, by a serial (the one record of what runs).
        self._in_flight: dict[int, list[Request]] = {}
        self._serials = itertools.count()
        self.stats = SchedulerStats()
        self._full_lanes = FullLanes(full_lanes)  # who a full lane refuses, for the ingress processes
        self._promised = PromisedPlaces()  # places promised to requests admitted by `admit`, not queued yet
        self._execution = BatchExecution(config, self._telemetry, self._clock, self._learned, self.stats,
                                         self._expire, self.limits.compute_budget_s, self._batch_ended)

    # --- settings ------------------------------------------------------------------------

    def update(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change batching settings and `max_batch_size` while serving; nothing queued is lost.

        All or nothing: the whole candidate is validated before anything applies. `max_batch_size`
        may not exceed the proven maximum; lanes are fixed while the model is loaded.
        """
        updated = self.limits.apply(changes)
        self._queue.max_queue_size = updated.max_queue_size
        self._queue.max_consecutive_high = updated.max_consecutive_high
        if not updated.reserve_instance_for_high:
            self._runners.unreserve()
        self._pump()
        return self.limits.settings()

    # --- runners -------------------------------------------------------------------------

    def add_runner(self, runner: BatchRunner) -> None:
        """Make a ready runner available for batches."""
        self._runners.add(runner, self.limits.batching.reserve_instance_for_high)
        self._pump()

    def remove_runner(self, runner: BatchRunner) -> None:
        """Hand `runner` no more batches (it died, or is being drained and replaced); a batch it is
        running still completes or fails through its own future."""
        self._runners.remove(runner)

    def _release(self, runner: BatchRunner) -> None:
        self._runners.release(runner, self.limits.batching.reserve_instance_for_high)

    # --- requests ------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting, all lanes together."""
        return len(self._queue)

    def tenant_depth(self, tenant: str) -> int:
        """Requests of `tenant` queued (every lane)."""
        return self._queue.tenant_depth(tenant)

    def lane_depths(self) -> dict[str, int]:
        """Requests waiting per lane."""
        return {name: self._queue.depth(i) for i, name in enumerate(self.lanes)}

    @property
    def running_rows(self) -> int:
        """Requests inside batches on runners right now."""
        return sum(len(batch) for batch in self._in_flight.values())

    def admit(self, lane: int, tenant: str = "") -> Promise:
        """Refuse at once (`Overloaded`, `ShuttingDown`) what `submit` would refuse, before the
        caller spends anything on decoding the request: a full lane refuses `tenant` only when it
        holds the most of the lane beyond its weighted share (`BatchQueue`'s fair admission), and
        places promised to requests admitted here but not queued yet count as taken. Returns the
        request's own promise of a place: hold it until the request is built."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        promised = self._promised.count(lane)
        if not self._queue.would_admit(lane, tenant, promised):
            raise self._refuse(lane, tenant, promised)
        return self._promised.promise(lane)

    def lane_places(self, lane: int) -> dict[str, int]:
        """Who holds `lane`'s queue places: queued requests per tenant."""
        return self._queue.places(lane)

    def _refresh_full_lanes(self) -> None:
        """Tell the ingress processes (engine/full_lanes.py) what changed in the (nearly) full lanes."""
        self._full_lanes.refresh(self._queue, len(self.lanes), self._predicted_drain_s, self.limits.max_batch_size)

    def _refuse(self, lane: int, tenant: str, promised: int = 0) -> Overloaded:
        """Count a refusal of `tenant`'s request by a full lane (`promised` of its places promised
        to requests on their way in) and build its error (naming the tenant and its places),
        Retry-After from the predicted drain."""
        self.stats.rejected += 1
        self._telemetry.count(lane, "rejected")
        return lane_full(self.config.name, self.lanes[lane], self._queue.depth(lane), tenant,
                         self._queue.places(lane).get(tenant, 0), self._predicted_drain_s(), promised)

    def submit(self, request: InferenceRequest, rows: int, coalesce: bool = False) -> asyncio.Future[RequestResult]:
        """Queue `request` in its lane; its future resolves with the result or a `ServeError`.

        `rows`: the request's rows, as the admission chain counted them (`check_inputs`).
        The deadline is the request's (`deadline_at`, absolute `time.monotonic()` seconds, the
        clock's `now()`); whether it can still be met was the chain's question (`FitsDeadline`), a
        deadline that passes while queued answers 503 `deadline_exceeded` at the next pump. Raises
        `Overloaded` at once when the lane is full and the request's tenant holds most of it beyond
        its share (another tenant's newest request is pushed out otherwise), `ShuttingDown` while
        draining. Cancelling the future (the client went away) drops the request before compute.

        A request is handed to a free runner before this returns, unless `coalesce`: then batches
        form once this event-loop step ends, with every request submitted during it. A pipeline's
        step asks for that: the requests of one step's batch all go on to their next step in the
        same loop step, and on a fast model (its instance free again by then) the first of them
        would otherwise go alone and the rest wait for it.
        """
        lane, tenant = request.lane, request.tenant
        if not self._accepting:
            self._telemetry.count(lane, "rejected")
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        if rows > self.limits.max_batch_size and self.config.max_batch_size > 0:
            raise InvalidInput(f"a batch of {rows} exceeds the current max_batch_size {self.limits.max_batch_size}")
        now = self._clock.now()
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        inputs = request.inputs
        shape_key = tuple((name, a.shape[1:], a.dtype.str) for name, a in inputs.items())
        mark = self._telemetry.mark(self._queue.depth(lane))  # queue position: requests ahead in its lane
        pending = PendingRequest(request, future, mark, self._precise())
        item = QueuedItem(pending, lane, rows, shape_key, request.deadline_at, now, tenant=tenant)
        admission = self._queue.push(item)
        if not admission.admitted:
            raise self._refuse(lane, tenant)
        if admission.displaced is not None:
            displaced = admission.displaced
            fail(displaced, self._refuse(lane, displaced.tenant))
        self._learned.arrivals.observe(now)
        future.add_done_callback(lambda f: self._on_cancel(item) if f.cancelled() else None)
        if coalesce:
            self._wakeups.soon()
        elif self._runners.any_idle:
            self._pump()
        else:
            # Every runner is busy: no batch can start before one ends, and its end pumps. Only the
            # new deadline may need the timer (a pump per submit cost a tenth of the engine's CPU
            # per request at saturation, expiring and timing nothing new).
            self._wakeups.by(item.deadline_at)
            self._refresh_full_lanes()
        return future

    def _on_cancel(self, item: Request) -> None:
        if item.queued:
            self.stats.cancelled += 1
            self._telemetry.count(item.lane, "cancelled")
        self._queue.cancel(item)
        self._check_drained()
        self._refresh_full_lanes()

    # --- the pump ------------------------------------------------------------------------

    def _pump(self) -> None:
        now = self._clock.now()
        for item in self._queue.expire(now):
            self._expire(item, f"the request waited {1000 * (now - item.enqueued_at):.0f} ms in the queue and passed "
                               "its deadline before the model could run it")
        wake_at: float | None = None
        while len(self._queue):
            lane = self._queue.next_lane()
            if lane is None:
                break
            runner = self._runners.take(lane)
            if runner is None and lane != 0 and self._queue.depth(0):
                lane = 0  # only the reserved instance is free, and urgent work waits
                runner = self._runners.take(lane)
            if runner is None:
                break
            head = self._queue.head(lane)
            wait_until = self._wait_until(lane, head, now) if head is not None else None
            if wait_until is not None:
                wake_at = wait_until
                self._release(runner)
                break
            batch = self._viable(self._queue.take_batch(self.limits.max_batch_size, lane), now)
            if not batch:
                self._release(runner)
                continue
            serial = next(self._serials)
            self._in_flight[serial] = batch  # in flight from now: drain waits for it
            self._start(runner, serial, batch)
        deadline = self._queue.next_deadline()
        if deadline is not None and (wake_at is None or deadline < wake_at):
            wake_at = deadline
        self._wakeups.at(wake_at)
        self._check_drained()
        self._refresh_full_lanes()

    def _expire(self, item: Request, why: str) -> None:
        self.stats.expired += 1
        self._telemetry.count(item.lane, "deadline_exceeded")
        fail(item, DeadlineExceeded(why))

    def _viable(self, items: list[Request], now: float) -> list[Request]:
        """Drop from a batch what nobody waits for any more, and what could only finish after its
        deadline (by the learned batch latency): an answer nobody can use costs compute others need."""
        latency = self._learned.latency
        finish_at = now + latency.predict(sum(i.rows for i in items)) if latency.observed else now
        batch = []
        for item in items:
            if item.payload.future.done():
                continue
            if item.deadline_at < finish_at:
                self._expire(item, f"the request would finish after its deadline (it waited "
                                   f"{1000 * (now - item.enqueued_at):.0f} ms, the batch takes about "
                                   f"{1000 * (finish_at - now):.0f} ms); it was not run")
                continue
            batch.append(item)
        return batch

    def _wait_until(self, lane: int, head: Request, now: float) -> float | None:
        """When a batch of `lane` led by `head` must start; None means now."""
        if lane == 0 or not self._accepting or self.limits.batching.policy == "idle":
            return None  # the first lane never waits; a draining server flushes; idle starts at once
        oldest = self._queue.oldest_enqueued_at(lane)
        op = BatchOpportunity(
            now, oldest if oldest is not None else head.enqueued_at,
            self._queue.ready_rows(lane, head.shape_key), self.limits.max_batch_size, max(1, self._runners.registered),
        )
        limits = PolicyLimits(self.limits.batching.max_wait_ms / 1000.0, self.limits.batching.latency_slo_ms / 1000.0)
        return POLICIES[self.limits.batching.policy](op, limits, self._learned)

    def _start(self, runner: BatchRunner, serial: int, batch: list[Request]) -> None:
        """Hand `batch` to `runner` now; `BatchExecution` follows it to its end (`_batch_ended`)."""
        self._execution.start(runner, serial, batch, self._clock.now())

    def _batch_ended(self, runner: BatchRunner, serial: int) -> None:
        """A batch ended, however: it is no longer in flight, its runner is free again."""
        del self._in_flight[serial]
        self._release(runner)
        self._pump()

    def _predicted_drain_s(self) -> float:
        """Seconds until the queue would drain at the learned batch latency."""
        latency = self._learned.latency
        per_batch = latency.predict(self.limits.max_batch_size) if latency.observed else 0.05
        batches = len(self._queue) / self.limits.max_batch_size / max(1, self._runners.registered)
        return max(1.0, batches * per_batch)

    # --- lifecycle -----------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop admitting and wait until every queued and running request has resolved."""
        self._accepting = False
        self._drained = asyncio.Event()
        self._pump()
        self._check_drained()
        await self._drained.wait()

    def fail_all(self, error: ServeError, running: bool = False) -> None:
        """Resolve every queued request with `error` (the model went away); with `running`, also
        those in batches that are running now (their answers will never be read)."""
        for item in self._queue.expire(float("inf")):
            fail(item, error)
        if running:
            for batch in list(self._in_flight.values()):
                for item in batch:
                    fail(item, error)
        self._check_drained()
        self._refresh_full_lanes()

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (`ShuttingDown`); queued ones still run."""
        self._accepting = False
        self._pump()

    def _check_drained(self) -> None:
        if self._drained is not None and not len(self._queue) and not self._in_flight:
            self._drained.set()

