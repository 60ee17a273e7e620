"""Keeping the loaded models within the memory budget (`PoolMemory`, owned by the model pool).

A load that does not fit the budget makes room first: idle models (no queued, running or waiting
request, not pinned, not being loaded or profiled) are evicted least recently used first until it
fits; when even that is not enough it is refused with the numbers. LRU is chosen over a cost-aware
policy for now: with Zipf traffic the recently used models are the hot ones, and the cost (load
time) of the models here differs by less than their reuse distance (see the note of issue 21 and
bench/model_pool.py).

The budget counts what each loaded model really holds once measured (its workers' Pss after
warm-up, then every `MEASURE_EVERY_S`; engine/memory_budget.py), when that is more than its estimate;
a model measured before is admitted by that figure when it loads again (H16). When measurements show
the loaded models over the budget, idle ones are evicted until it fits again. An idle sweep unloads
a model after its `idle_unload_s` without a request, and an operator may evict one.

While a model's workers stop for an eviction it is "being evicted" (its `ModelSlot` lifecycle): a
request for it waits for the eviction to end and then for its load (issue 45 W2).

The eager mode (every model loads at start) shares the budget check and the measurements but never
evicts to make room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

from servewell.engine.memory_budget import MemoryBudget, MemoryEstimate, MiB
from servewell.engine.memory_meter import Loaded, MemoryMeter, loaded_versions
from servewell.engine.model_slot import ModelSlot, is_pipeline
from servewell.errors import Conflict, ModelLoading, ModelNotReady

if TYPE_CHECKING:
    from servewell.engine.model_entry import ModelEntry
    from servewell.observability.metrics import ServeMetrics

log = logging.getLogger("servewell.engine")

EvictReason = Literal["memory", "idle", "operator"]
#: Retry-After of a `model_loading` refusal before the model's load time has ever been measured.
DEFAULT_LOAD_RETRY_S = 5.0
#: How often idle models are looked for (and the idle unload's precision).
IDLE_SWEEP_S = 1.0
#: How often a lazy load that waits for busy models to go idle looks again.
ROOM_RETRY_S = 0.05
#: How often every loaded model's memory is measured again (engine/memory_meter.py).
MEASURE_EVERY_S = 5.0


class PoolMemory:
    """Keeps one engine's loaded models within its memory budget: reserves each load's memory
    (evicting idle models first in lazy mode), measures what loaded models hold and evicts when that
    overcommits the budget, unloads models idle for longer than their `idle_unload_s`, and carries
    out an operator's evict."""

    def __init__(self, slots: Mapping[str, ModelSlot], budget: MemoryBudget, lazy: bool,
                 idle_unload_s: Callable[[ModelSlot], float], metrics: ServeMetrics | None = None) -> None:
        self._slots = slots
        self._budget = budget
        self._lazy = lazy  # eager: never evicts to make room
        self._idle_unload_s = idle_unload_s
        self._metrics = metrics
        self._meter = MemoryMeter(budget)  # what loaded models really hold, for the budget
        self._room = asyncio.Lock()  # one eviction decision at a time

    # --- making room ---------------------------------------------------------------------

    async def make_room(self, entry: ModelEntry, estimate: MemoryEstimate) -> None:
        """Reserve `estimate` for `entry`, evicting idle models first in lazy mode;
        `MemoryError` with the numbers when it cannot fit."""
        async with self._room:
            host, device = self._budget.shortfall(entry, estimate)
            if not (host or device) or not self._lazy:
                self._budget.reserve(entry, estimate, entry.label)
                return
            victims = self._victims(entry.name, host, device)
            if victims is None:
                self._budget.reserve(entry, estimate, entry.label, self._held_elsewhere(entry.name))
                return
            why = f"to make room for {entry.label} ({estimate.total_bytes / MiB:.0f} MiB)"
            await asyncio.gather(*(self._evict(slot, "memory", why) for slot in victims))
            self._budget.reserve(entry, estimate, entry.label, self._held_elsewhere(entry.name))

    async def reserve_for_load(self, entry: ModelEntry, estimate: MemoryEstimate, until: float) -> None:
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
        candidates = sorted((s for s in self._slots.values() if s.name != name and self.evictable(s)),
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

    def evictable(self, slot: ModelSlot) -> bool:
        """Whether `slot`'s model may be evicted now: it serves, is not pinned and nothing is queued,
        running or waiting for it."""
        return slot.entry.lifecycle.serving and not slot.pinned and not slot.busy()

    def _held_elsewhere(self, name: str) -> str:
        """What holds the budget that eviction may not take, for the refusal's message."""
        pinned = busy = 0
        for slot in self._slots.values():
            held = self._budget.held_bytes(slot.entry)
            if slot.name == name or held is None:
                continue
            if slot.pinned:
                pinned += held
            elif not self.evictable(slot):
                busy += held
        return f" ({pinned / MiB:.0f} MiB held by pinned models, {busy / MiB:.0f} MiB by models with work in flight)"

    async def _evict(self, slot: ModelSlot, reason: EvictReason, why: str) -> None:
        entry = slot.entry
        freed = self._budget.held_bytes(entry) or 0
        # Until the workers have stopped, the model is "being evicted": a request for it waits for
        # that, then for its load (`ModelPool.loadable`, `_load`), instead of a 503 (issue 45 W2).
        # It shows as evicted from now on, so it is counted now too: the view and the counts agree.
        slot.begin_eviction()
        slot.evictions += 1
        if self._metrics is not None:
            self._metrics.model_evictions.labels(slot.name, reason).inc()
        try:
            await entry.stop("evicting", f"evicted ({reason}): {why}")
        finally:
            slot.end_eviction()
        log.info("evicted %s (%s): %s", slot.name, reason, why,
                 extra={"event": "model_evicted", "model": slot.name, "reason": reason, "freed_bytes": freed})

    async def evict(self, slot: ModelSlot) -> None:
        """An operator's eviction: `Conflict` when the model is a pipeline, pinned, busy or not resident."""
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

    # --- what loaded models really hold ----------------------------------------------------

    async def measure(self, loaded: list[Loaded]) -> None:
        """Measure the workers of `loaded` now (after a warm-up: what it holds counts from now on)."""
        await self._meter.measure(loaded)

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

    async def watch_memory(self) -> None:
        """Measure every loaded version each `MEASURE_EVERY_S` (and in lazy mode settle an
        overcommitted budget); a background task of the pool."""
        while True:
            await asyncio.sleep(MEASURE_EVERY_S)
            try:
                await self._meter.measure(loaded_versions(self._slots.values()))
                if self._lazy:
                    await self._settle_overcommit()
            except Exception:  # never let the watch die
                log.exception("measuring the models' memory failed")

    async def sweep_idle(self) -> None:
        """Unload the models idle for longer than their `idle_unload_s` (checked each `IDLE_SWEEP_S`);
        a background task of the pool in lazy mode."""
        while True:
            await asyncio.sleep(IDLE_SWEEP_S)
            now = time.time()
            for slot in list(self._slots.values()):
                limit = self._idle_unload_s(slot)
                if limit <= 0 or not self.evictable(slot):
                    continue
                idle = slot.idle_s(now)
                if idle >= limit:
                    try:
                        async with self._room:
                            if self.evictable(slot):
                                await self._evict(slot, "idle", f"after {idle:.0f} s without a request")
                    except Exception:  # never let the sweep die
                        log.exception("idle unload of %s failed", slot.name)
