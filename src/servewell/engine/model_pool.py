"""Many models in one memory budget: lazy loading on first request (`ModelPool`); keeping the loaded
models within the budget, with evictions and idle unloads, is `PoolMemory` (engine/pool_memory.py).

In `lazy` repository mode a model is listed (with its estimated memory) but loads when a request
first needs it. The request waits for the load (one load per model at a time; at most
`max_concurrent_loads` across models) up to its deadline or `max_load_wait_ms`; past
`load_queue_per_model` waiting requests, or when the wait runs out, it gets 503 `model_loading`
with a Retry-After from the model's measured load time. A load reserves its memory first
(`PoolMemory.reserve_for_load`: idle models are evicted to make room).

A request for a model that is being evicted waits for the eviction to end and then for the model's
load, like any request for a model that is not resident (issue 45 W2: it got an immediate 503
model_loading). A model whose estimate alone is more than the whole budget never loads (the engine
lists it as invalid with the numbers, engine/model_registry.py), rather than being refused at each
request as if eviction could help (W3).

Whether a request loads a model, and where a model is, are its lifecycle's answers
(engine/model_lifecycle.py); the pool adds what only it knows: the repository mode, and that a
pipeline holds no memory and is never loaded here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from servewell.engine.memory_budget import MemoryBudget, estimate_model_memory
from servewell.engine.model_lifecycle import not_ready
from servewell.engine.model_slot import ModelSlot, is_pipeline
from servewell.engine.pool_memory import DEFAULT_LOAD_RETRY_S, PoolMemory
from servewell.engine.protocol import ModelState
from servewell.errors import ModelLoading, ModelNotReady, NotFound, ShuttingDown

if TYPE_CHECKING:
    from servewell.config.model import ModelConfig
    from servewell.engine.model_entry import ModelEntry
    from servewell.observability.metrics import ServeMetrics

log = logging.getLogger("servewell.engine")

RepositoryMode = Literal["eager", "lazy"]
#: Rounds of "wait for the load" one request makes before it gives up (each ends with a load that
#: finished; the model evicted again before the request's turn is the only way round).
ACQUIRE_ROUNDS = 8


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The repository mode and the lazy mode's bounds (config/server.py documents each)."""

    mode: RepositoryMode = "eager"
    poll_s: float = 5.0
    max_load_wait_s: float = 30.0
    max_concurrent_loads: int = 2
    load_queue_per_model: int = 64
    idle_unload_s: float = 0.0

    @property
    def lazy(self) -> bool:
        """Whether models load on their first request."""
        return self.mode == "lazy"

    def idle_unload_of(self, slot: ModelSlot) -> float:
        """Seconds without a request after which `slot`'s model is unloaded (0: never): its
        model.yaml's `idle_unload_s`, else the server's."""
        config = slot.entry.config
        own = config.idle_unload_s if config is not None else None
        return self.idle_unload_s if own is None else own


class ModelPool:
    """Loads one engine's models when requests need them (lazy mode), one load per model at a time,
    each request waiting a bounded time; its `memory` keeps them within the budget."""

    def __init__(self, settings: PoolSettings, slots: Mapping[str, ModelSlot], budget: MemoryBudget,
                 memory: PoolMemory, new_entry: Callable[[str, ModelConfig], ModelEntry],
                 metrics: ServeMetrics | None = None,
                 loaded: Callable[[ModelSlot], Awaitable[None]] | None = None) -> None:
        self.settings = settings
        #: Called (with the slot's lock held) once a lazy load made the model resident: the engine
        #: loads the versions its model.yaml names then (its traffic split, its shadow).
        self._loaded = loaded
        self._slots = slots
        self._budget = budget
        self._new_entry = new_entry  # (name, config) -> a fresh, unloaded ModelEntry
        self._metrics = metrics
        #: Reservations, measurements, evictions and idle unloads (engine/pool_memory.py).
        self.memory = memory
        self._loads = asyncio.Semaphore(settings.max_concurrent_loads)
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False  # shutting down: no lazy load starts

    @property
    def lazy(self) -> bool:
        """Whether models load on their first request."""
        return self.settings.lazy

    def start(self, rescan: Callable[[], Awaitable[list[str]]] | None) -> None:
        """Start the memory measurements, and in lazy mode the idle sweep and the repository poll
        (`rescan`: adds the models whose directories are new and removes those whose directories
        are gone, returns the names it added)."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.memory.watch_memory()))
        if not self.lazy:
            return
        self._tasks.append(loop.create_task(self.memory.sweep_idle()))
        if rescan is not None and self.settings.poll_s > 0:
            self._tasks.append(loop.create_task(self._poll(rescan)))

    def stop(self) -> None:
        """The server is shutting down: stop the background tasks and start no load from now on."""
        self.closed = True
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()

    def readiness_state(self, slot: ModelSlot) -> ModelState:
        """The state the readiness policy counts: in lazy mode a model that loads on its first
        request counts as ready (the server can serve it), but a pinned one loads at start and
        counts as loading until it has."""
        if not self.loadable(slot):
            return slot.entry.state
        if not slot.pinned:
            return "ready"
        return "loading" if slot.residency() == "loading" or slot.cold_starts == 0 else slot.entry.state

    def report(self) -> dict[str, Any]:
        """The pool as /healthz and the console show it: mode, budgets, counts."""
        slots = list(self._slots.values())
        budget = self._budget
        return {
            "mode": self.settings.mode,
            # reserved: what the budget counts, each model's estimate or its measurement when more
            "budget_bytes": budget.total_bytes, "reserved_bytes": budget.used_bytes,
            "estimated_bytes": budget.estimated_bytes, "measured_bytes": budget.measured_bytes,
            "device_budget_bytes": budget.device_total_bytes, "device_reserved_bytes": budget.device_used_bytes,
            "resident": sum(1 for s in slots if s.resident),
            "loading": sum(1 for s in slots if s.residency() == "loading"),
            "models": len(slots),
            "pinned": sum(1 for s in slots if s.pinned),
            "loads_in_flight": sum(1 for s in slots if s.loader is not None and not s.loader.done()),
            "waiting_requests": sum(s.waiting for s in slots),
        }

    def count(self, slot: ModelSlot) -> None:
        """Count a request in lazy mode: a hit when its model is resident, a miss when it must load."""
        if self._metrics is not None and self.lazy and not is_pipeline(slot):  # a pipeline's steps count
            self._metrics.pool_requests.labels("hit" if slot.resident else "miss").inc()

    def loadable(self, slot: ModelSlot) -> bool:
        """Whether a request would load this model now: lazy mode, a valid config, not a pipeline,
        and its lifecycle says a request loads it (`ResidencyLifecycle.loads_on_request`)."""
        entry = slot.entry
        if not self.lazy or entry.config is None or is_pipeline(slot):
            return False
        return slot.lifecycle.loads_on_request(entry.lifecycle)

    # --- waiting for a load ------------------------------------------------------------------

    async def acquire(self, slot: ModelSlot, deadline: float | None) -> None:
        """Return once `slot`'s model is resident, loading it if needed (one being evicted: once the
        eviction ended, loaded again), waiting at most until `deadline` (absolute `time.monotonic()`)
        and `max_load_wait_ms`; `ModelLoading` when the wait queue is full or the wait ran out,
        `ModelNotReady` when it cannot be loaded, `NotFound` once its directory was removed."""
        started = time.monotonic()
        until = started + self.settings.max_load_wait_s
        if deadline is not None:
            until = min(until, deadline)
        for _ in range(ACQUIRE_ROUNDS):  # an eviction between the load and this waiter's turn is retried
            if slot.resident:
                return
            if self.closed:
                raise ShuttingDown("the server is shutting down and loads no model")
            if slot.removed:
                raise NotFound(f"model '{slot.name}' was removed from the repository")
            if not self.loadable(slot):
                entry = slot.entry
                raise not_ready(slot.name, entry.state, entry.reason)
            slot.wanted_at = now = time.monotonic()
            if slot.waiting >= self.settings.load_queue_per_model:
                self._loader(slot)  # refused, but the load it asks for starts
                raise ModelLoading(f"model '{slot.name}' is loading and {slot.waiting} requests already wait for it "
                                   f"(load_queue_per_model); retry", retry_after_s=self.retry_after_s(slot))
            if until <= now:
                raise ModelLoading(f"model '{slot.name}' is not loaded and the request has no time left to wait "
                                   f"for its load (it waited {now - started:.1f} s); retry",
                                   retry_after_s=self.retry_after_s(slot))
            slot.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(self._loader(slot)), until - now)
            except TimeoutError:
                raise ModelLoading(f"model '{slot.name}' is still loading after the request waited "
                                   f"{time.monotonic() - started:.1f} s; retry",
                                   retry_after_s=self.retry_after_s(slot)) from None
            finally:
                slot.waiting -= 1
        if not slot.resident:
            raise ModelLoading(f"model '{slot.name}' was evicted again while this request waited; retry",
                               retry_after_s=self.retry_after_s(slot))

    def demand_window_s(self, slot: ModelSlot) -> float:
        """How long a queued load still runs after the last request that asked for it: two of the
        Retry-After it was given (a client that honours it asks again within one), at least 5 s."""
        return max(5.0, 2 * self.retry_after_s(slot))

    def retry_after_s(self, slot: ModelSlot) -> float:
        """About one load time of the model (its last measured load, else a default)."""
        return max(1.0, round(slot.load_s if slot.load_s is not None else DEFAULT_LOAD_RETRY_S, 1))

    def _loader(self, slot: ModelSlot) -> asyncio.Task[None]:
        if slot.loader is None or slot.loader.done():
            slot.loader = asyncio.get_running_loop().create_task(self._load(slot))
            slot.loader.add_done_callback(_consume)
        return slot.loader

    async def _load(self, slot: ModelSlot) -> None:
        started = time.monotonic()
        waited_by = slot.waiting
        eviction = slot.eviction_ended()
        if eviction is not None:
            await asyncio.shield(eviction)  # being evicted: its workers stop first, then it loads again
        async with self._loads, slot.lock:
            if slot.resident or not self.loadable(slot):
                return
            unwanted_s = time.monotonic() - slot.wanted_at
            if slot.waiting == 0 and unwanted_s > self.demand_window_s(slot):
                # Every request that asked gave up while the load queued behind others (measured: at
                # 8 req/s of Zipf traffic over 199 models on 2 cores, loads nobody waited for any more
                # took the load slots and cold starts reached a p50 of 42 s). A retry asks again.
                log.info("load of %s skipped: no request has asked for it for %.1f s", slot.name, unwanted_s,
                         extra={"event": "load_skipped", "model": slot.name})
                return
            config = slot.entry.config
            assert config is not None  # loadable
            entry = self._new_entry(slot.name, config)
            try:
                estimate = estimate_model_memory(config, entry.directory)
            except (OSError, ValueError) as exc:
                raise ModelNotReady(f"model '{slot.name}' cannot be loaded: {exc}") from None
            measured = slot.measured_bytes if slot.measured_config == config else None
            if measured is not None:  # admitted by what it held when it last ran, not by the guess
                self._budget.measure(entry, measured)
            # Room first, the entry swapped in after: a load that waits for room or is refused for
            # it leaves the model as it was (loadable), not failed. One that could never fit (its
            # last measurement is more than the whole budget) goes on to fail, naming the numbers.
            if self._budget.beyond_whole_budget(estimate, entry.label, measured or 0) is None:
                try:
                    await self.memory.reserve_for_load(entry, estimate, started + self.settings.max_load_wait_s)
                except BaseException:
                    self._budget.release(entry)  # the measurement given above
                    raise
            if slot.removed:  # its directory went while it waited for room: nothing to load any more
                self._budget.release(entry)
                raise NotFound(f"model '{slot.name}' was removed from the repository")
            previous = slot.serve(entry)
            try:
                await entry.load()  # its own reservation is in place: make_room finds it fits
            finally:
                if not entry.lifecycle.serving:  # failed (load releases), or an unexpected error or cancel
                    self._budget.release(entry)
                await previous.release_snapshot()  # the new snapshot has linked what it could from it
            if not entry.lifecycle.serving:
                raise ModelNotReady(f"model '{slot.name}' failed to load: {entry.reason}")
            await self.memory.measure([(slot, entry)])  # after warm-up: what it holds counts from now on
            if self._loaded is not None:
                await self._loaded(slot)  # a cold load follows the split as a load at start does
        seconds = time.monotonic() - started
        slot.resident_at = time.time()
        slot.load_s = entry.load_s or seconds
        slot.cold_starts += 1
        if self._metrics is not None:
            self._metrics.cold_start.labels(slot.name).observe(seconds)
        log.info("cold start of %s: %.2f s (waited by %d requests)", slot.name, seconds, max(waited_by, slot.waiting),
                 extra={"event": "cold_start", "model": slot.name, "seconds": round(seconds, 3)})

    # --- background ----------------------------------------------------------------------

    async def _poll(self, rescan: Callable[[], Awaitable[list[str]]]) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                added = await rescan()
            except Exception:  # never let the poll die
                log.exception("polling the model repository failed")
                continue
            for name in added:
                log.info("new model %s found in the repository (lazy: loads on its first request)", name,
                         extra={"event": "model_discovered", "model": name})


def _consume(task: asyncio.Task[None]) -> None:
    """A load's error reaches its waiters; one nobody waited for (all timed out) must not be logged
    as 'never retrieved'."""
    if not task.cancelled():
        task.exception()
