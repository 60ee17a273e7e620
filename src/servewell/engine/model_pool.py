"""Many models in one memory budget: lazy loading on first request, eviction, idle unloads.

In `lazy` repository mode a model is listed (with its estimated memory) but loads when a request
first needs it. The request waits for the load (one load per model at a time; at most
`max_concurrent_loads` across models) up to its deadline or `max_load_wait_ms`; past
`load_queue_per_model` waiting requests, or when the wait runs out, it gets 503 `model_loading`
with a Retry-After from the model's measured load time.

A load that does not fit the budget makes room first: idle models (no queued, running or waiting
request, not pinned, not being loaded or profiled) are evicted least recently used first until it
fits; when even that is not enough it is refused with the numbers. LRU is chosen over a
cost-aware policy for now: with Zipf traffic the recently used models are the hot ones, and the
cost (load time) of the models here differs by less than their reuse distance (see the note of
issue 21 and bench/model_pool.py).

A request for a model that is being evicted waits for the eviction to end and then for the model's
load, like any request for a model that is not resident (issue 45 W2: it got an immediate 503
model_loading). A model whose estimate alone is more than the whole budget never loads (the engine
lists it as invalid with the numbers, engine/engine.py), rather than being refused at each request
as if eviction could help (W3).

The budget counts what each loaded model really holds once measured (its workers' Pss after
warm-up, then every `MEASURE_EVERY_S`; engine/memory_budget.py), when that is more than its estimate;
a model measured before is admitted by that figure when it loads again (H16). When measurements show
the loaded models over the budget, idle ones are evicted until it fits again.

The eager mode (every model loads at start) shares the budget check and the measurements but never
evicts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from servewell.engine.entry import not_ready
from servewell.engine.memory_budget import MemoryBudget, MemoryEstimate, MiB, estimate_model_memory
from servewell.engine.memory_meter import MemoryMeter, loaded_versions
from servewell.engine.model_slot import ModelSlot, is_pipeline
from servewell.engine.protocol import ModelState
from servewell.errors import Conflict, ModelLoading, ModelNotReady, NotFound, ShuttingDown

if TYPE_CHECKING:
    from servewell.config.model import ModelConfig
    from servewell.engine.model_entry import ModelEntry
    from servewell.observability.metrics import ServeMetrics

log = logging.getLogger("servewell.engine")

RepositoryMode = Literal["eager", "lazy"]
EvictReason = Literal["memory", "idle", "operator"]
#: Retry-After of a `model_loading` refusal before the model's load time has ever been measured.
DEFAULT_LOAD_RETRY_S = 5.0
#: How often idle models are looked for (and the idle unload's precision).
IDLE_SWEEP_S = 1.0
#: How often a lazy load that waits for busy models to go idle looks again.
ROOM_RETRY_S = 0.05
#: How often every loaded model's memory is measured again (engine/memory_meter.py).
MEASURE_EVERY_S = 5.0
#: Rounds of "wait for the load" one request makes before it gives up (each ends with a load that
#: finished; the model evicted again before the request's turn is the only way round).
ACQUIRE_ROUNDS = 8
#: Models removed from the repository that /healthz lists (the most recent).
REMOVED_KEPT = 20


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The repository mode and the lazy mode's bounds (config/server.py documents each)."""

    mode: RepositoryMode = "eager"
    poll_s: float = 5.0
    max_load_wait_s: float = 30.0
    max_concurrent_loads: int = 2
    load_queue_per_model: int = 64
    idle_unload_s: float = 0.0


class ModelPool:
    """Lazy loads, eviction and idle unloads of one engine's models (`InferenceEngine` owns it)."""

    def __init__(self, settings: PoolSettings, slots: dict[str, ModelSlot], budget: MemoryBudget,
                 new_entry: Callable[[str, ModelConfig], ModelEntry],
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
        self._meter = MemoryMeter(budget)  # what loaded models really hold, for the budget
        self._loads = asyncio.Semaphore(settings.max_concurrent_loads)
        self._room = asyncio.Lock()  # one eviction decision at a time
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False  # shutting down: no lazy load starts
        #: Models and versions whose directory was removed, most recent last (/healthz shows them).
        self.removed: deque[dict[str, Any]] = deque(maxlen=REMOVED_KEPT)

    @property
    def lazy(self) -> bool:
        """Whether models load on their first request."""
        return self.settings.mode == "lazy"

    def start(self, rescan: Callable[[], Awaitable[list[str]]] | None) -> None:
        """Start the memory measurements, and in lazy mode the idle sweep and the repository poll
        (`rescan`: adds the models whose directories are new and removes those whose directories
        are gone, returns the names it added)."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._watch_memory()))
        if not self.lazy:
            return
        self._tasks.append(loop.create_task(self._sweep_idle()))
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
            "removed": list(self.removed),
        }

    def note_removed(self, name: str, version: str | None, why: str) -> None:
        """Record that a model (or one of its versions) was taken out because its files are gone."""
        self.removed.append({"model": name, "version": version, "at": time.time(), "reason": why})

    def count(self, slot: ModelSlot) -> None:
        """Count a request in lazy mode: a hit when its model is resident, a miss when it must load."""
        if self._metrics is not None and self.lazy and not is_pipeline(slot):  # a pipeline's steps count
            self._metrics.pool_requests.labels("hit" if slot.resident else "miss").inc()

    def loadable(self, slot: ModelSlot) -> bool:
        """Whether a request would load this model now (lazy mode, a valid config, not unloaded by
        an operator, not failed since its last change, not removed); a model being evicted is: its
        requests wait for the eviction to end, then for the load."""
        entry = slot.entry
        if not self.lazy or entry.config is None or is_pipeline(slot) or slot.unloaded_by_operator or slot.removed:
            return False
        return entry.state in ("unloaded", "loading") or slot.eviction is not None

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
        eviction = slot.eviction
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
                    await self._reserve(entry, estimate, started + self.settings.max_load_wait_s)
                except BaseException:
                    self._budget.release(entry)  # the measurement given above
                    raise
            previous, slot.entry = slot.entry, entry
            try:
                await entry.load()  # its own reservation is in place: make_room finds it fits
            finally:
                if entry.state != "ready":  # failed (load releases), or an unexpected error or cancel
                    self._budget.release(entry)
                await previous.release_snapshot()  # the new snapshot has linked what it could from it
            if entry.state != "ready":
                raise ModelNotReady(f"model '{slot.name}' failed to load: {entry.reason}")
            await self._meter.measure([(slot, entry)])  # after warm-up: what it holds counts from now on
            if self._loaded is not None:
                await self._loaded(slot)  # a cold load follows the split as a load at start does
        seconds = time.monotonic() - started
        slot.load_s = entry.load_s or seconds
        slot.cold_starts += 1
        slot.evicted = False
        if self._metrics is not None:
            self._metrics.cold_start.labels(slot.name).observe(seconds)
        log.info("cold start of %s: %.2f s (waited by %d requests)", slot.name, seconds, max(waited_by, slot.waiting),
                 extra={"event": "cold_start", "model": slot.name, "seconds": round(seconds, 3)})

    # --- making room ---------------------------------------------------------------------

    async def make_room(self, entry: ModelEntry, estimate: MemoryEstimate) -> None:
        """Reserve `estimate` for `entry`, evicting idle models first in lazy mode;
        `MemoryError` with the numbers when it cannot fit."""
        async with self._room:
            host, device = self._budget.shortfall(entry, estimate)
            if not (host or device) or not self.lazy:
                self._budget.reserve(entry, estimate, entry.label)
                return
            victims = self._victims(entry.name, host, device)
            if victims is None:
                self._budget.reserve(entry, estimate, entry.label, self._held_elsewhere(entry.name))
                return
            why = f"to make room for {entry.label} ({estimate.total_bytes / MiB:.0f} MiB)"
            await asyncio.gather(*(self._evict(slot, "memory", why) for slot in victims))
            self._budget.reserve(entry, estimate, entry.label, self._held_elsewhere(entry.name))

    async def _reserve(self, entry: ModelEntry, estimate: MemoryEstimate, until: float) -> None:
        """Reserve for a lazy load: evict idle models; when only models with work in flight hold the
        memory, wait for them to go idle until `until` (then `ModelLoading`); when even evicting every
        unpinned model would not make room, refuse with the numbers (`ModelNotReady`)."""
        while True:
            try:
                await self.make_room(entry, estimate)
                return
            except MemoryError as exc:
                if not self._fits_without_busy(entry, estimate):
                    raise ModelNotReady(f"model '{entry.name}' cannot be loaded: {exc}") from None
                if time.monotonic() >= until:
                    raise ModelLoading(f"model '{entry.name}' waits for memory held by models with work in flight: "
                                       f"{exc}; retry", retry_after_s=DEFAULT_LOAD_RETRY_S) from None
            await asyncio.sleep(ROOM_RETRY_S)

    def _fits_without_busy(self, entry: ModelEntry, estimate: MemoryEstimate) -> bool:
        """Whether `estimate` would fit once every unpinned model is evicted (busy ones included)."""
        host = max(estimate.total_bytes, self._budget.measured_by(entry) or 0)
        device = estimate.device_bytes
        for slot in self._slots.values():
            held = self._budget.reserved_by(slot.entry)
            if held is not None and slot.name != entry.name and slot.pinned:
                host += self._budget.held_bytes(slot.entry) or 0
                device += held.device_bytes
        device_total = self._budget.device_total_bytes
        return host <= self._budget.total_bytes and (device_total is None or device <= device_total)

    def _victims(self, name: str, host: int, device: int) -> list[ModelSlot] | None:
        """The least recently used idle models whose memory covers the shortfall (None: not enough)."""
        candidates = sorted((s for s in self._slots.values() if s.name != name and self._evictable(s)),
                            key=lambda s: s.last_used_at or 0.0)
        chosen: list[ModelSlot] = []
        for slot in candidates:
            if host <= 0 and device <= 0:
                break
            held = self._budget.reserved_by(slot.entry)
            if held is None:
                continue
            held_host = self._budget.held_bytes(slot.entry) or 0  # its measurement, when more than its estimate
            if (host > 0 and held_host) or (device > 0 and held.device_bytes):
                chosen.append(slot)
                host -= held_host
                device -= held.device_bytes
        return chosen if host <= 0 and device <= 0 else None

    def _evictable(self, slot: ModelSlot) -> bool:
        return slot.resident and slot.entry.state == "ready" and not slot.pinned and not slot.busy()

    def _held_elsewhere(self, name: str) -> str:
        """What holds the budget that eviction may not take, for the refusal's message."""
        pinned = busy = 0
        for slot in self._slots.values():
            held = self._budget.held_bytes(slot.entry)
            if slot.name == name or held is None:
                continue
            if slot.pinned:
                pinned += held
            elif not self._evictable(slot):
                busy += held
        return f" ({pinned / MiB:.0f} MiB held by pinned models, {busy / MiB:.0f} MiB by models with work in flight)"

    async def _evict(self, slot: ModelSlot, reason: EvictReason, why: str) -> None:
        entry = slot.entry
        freed = self._budget.held_bytes(entry) or 0
        # Until the workers have stopped, the model is "being evicted": a request for it waits for
        # that, then for its load (`loadable`, `_load`), instead of a 503 (issue 45 W2).
        ended = slot.eviction = asyncio.get_running_loop().create_future()
        try:
            await entry.stop("evicting", "unloaded", f"evicted ({reason}): {why}")
        finally:
            if slot.eviction is ended:
                slot.eviction = None
            ended.set_result(None)
        if slot.entry is entry:  # a load swaps in a new entry only after this eviction ended
            slot.evicted = reason != "operator"
        slot.evictions += 1
        if self._metrics is not None:
            self._metrics.model_evictions.labels(slot.name, reason).inc()
        log.info("evicted %s (%s): %s", slot.name, reason, why,
                 extra={"event": "model_evicted", "model": slot.name, "reason": reason, "freed_bytes": freed})

    async def evict(self, slot: ModelSlot) -> None:
        """An operator's eviction: `Conflict` when the model is pinned, busy or not resident."""
        if is_pipeline(slot):
            raise Conflict(f"model '{slot.name}' is a pipeline: it holds no memory (evict its step models)")
        if slot.pinned:
            raise Conflict(f"model '{slot.name}' is pinned; unpin it first")
        if not slot.resident:
            raise Conflict(f"model '{slot.name}' is not resident ({slot.residency()})")
        if slot.busy():
            raise Conflict(f"model '{slot.name}' has work in flight; retry when it is idle")
        async with self._room:
            await self._evict(slot, "operator", "POST /admin/models/{name}/evict")
        slot.evicted = True

    # --- what loaded models really hold ----------------------------------------------------

    async def _settle_overcommit(self) -> None:
        """Measurements may show the loaded models holding more than the budget, though their
        estimates fit: evict idle models (least recently used first) until what is counted fits."""
        async with self._room:
            over = self._budget.used_bytes - self._budget.total_bytes
            if over <= 0:
                return
            victims = self._victims("", over, 0)
            if victims is None:
                return  # only pinned or busy models hold it: the next loads wait or are refused instead
            why = (f"the loaded models were measured at {self._budget.used_bytes / MiB:.0f} MiB, over the "
                   f"{self._budget.total_bytes / MiB:.0f} MiB budget")
            await asyncio.gather(*(self._evict(slot, "memory", why) for slot in victims))

    async def _watch_memory(self) -> None:
        while True:
            await asyncio.sleep(MEASURE_EVERY_S)
            try:
                await self._meter.measure(loaded_versions(self._slots.values()))
                if self.lazy:
                    await self._settle_overcommit()
            except Exception:  # never let the watch die
                log.exception("measuring the models' memory failed")

    # --- background ----------------------------------------------------------------------

    def idle_unload_s(self, slot: ModelSlot) -> float:
        """Seconds without a request after which the model is unloaded (0: never)."""
        config = slot.entry.config
        own = config.idle_unload_s if config is not None else None
        return self.settings.idle_unload_s if own is None else own

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(IDLE_SWEEP_S)
            now = time.time()
            for slot in list(self._slots.values()):
                limit = self.idle_unload_s(slot)
                if limit <= 0 or not self._evictable(slot):
                    continue
                idle = now - (slot.last_used_at or now)
                if idle >= limit:
                    try:
                        async with self._room:
                            if self._evictable(slot):
                                await self._evict(slot, "idle", f"after {idle:.0f} s without a request")
                    except Exception:  # never let the sweep die
                        log.exception("idle unload of %s failed", slot.name)

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
