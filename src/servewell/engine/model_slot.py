"""What the engine knows of one model name across its loads (`ModelSlot`): the entry that serves it
now (a reload or a lazy load swaps the entry, never the slot), its lock, its residency in the model
pool (engine/model_lifecycle.py), what the pool counts of it (last use, pin, evictions, what it was
measured to hold) and its traffic split.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from servewell.engine.entry import Entry
from servewell.engine.model_lifecycle import Residency, ResidencyLifecycle

if TYPE_CHECKING:
    from servewell.config.model import ModelConfig
    from servewell.engine.rollout import Rollout


class ModelSlot:
    """Where one model name's current entry lives; a reload or a lazy load swaps the entry, not
    the slot. Also what the pool knows of the name across loads: residency, last use, pin, counts."""

    __slots__ = ("entry", "lock", "lifecycle", "profiling", "last_used_at", "resident_at", "pinned_by_admin", "waiting",
                 "loader", "cold_starts", "evictions", "load_s", "estimated_bytes", "wanted_at", "rollout", "_eviction",
                 "measured_bytes", "measured_config")

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.lock = asyncio.Lock()  # one load/unload of this model at a time
        self.lifecycle = ResidencyLifecycle()
        self.profiling = False  # a profile capture runs on one of its workers (it must not be evicted)
        self.last_used_at: float | None = None  # wall clock of the last request (None: never used)
        self.resident_at: float | None = None  # wall clock a lazy load last made it resident
        self.pinned_by_admin: bool | None = None  # POST .../pin or /unpin; None: model.yaml's pinned
        self.waiting = 0  # requests waiting for this model's lazy load
        self.loader: asyncio.Task[None] | None = None  # the lazy load under way (engine/model_pool.py)
        self.cold_starts = 0
        self.evictions = 0
        self.load_s: float | None = None  # the last measured load (Retry-After of model_loading)
        self.estimated_bytes: int | None = None
        self.wanted_at = 0.0  # monotonic time a request last asked for this model's load
        self.rollout: Rollout | None = None  # its other versions and traffic split (engine/rollout.py)
        self._eviction: asyncio.Future[None] | None = None  # done when the eviction under way has ended
        self.measured_bytes: int | None = None  # what its workers held when last measured (kept across loads)
        self.measured_config: ModelConfig | None = None  # the config that measurement was of

    @property
    def name(self) -> str:
        """The model's name."""
        return self.entry.name

    @property
    def pinned(self) -> bool:
        """Never evicted: an admin's pin or unpin, else model.yaml's `pinned`."""
        if is_pipeline(self):
            return True  # it holds no memory: nothing to gain by evicting it
        config = self.entry.config
        if self.rollout is not None or (config is not None and config.other_versions):
            return True  # a rollout in progress: its versions and verdicts live as long as the model
        if self.pinned_by_admin is not None:
            return self.pinned_by_admin
        return bool(config is not None and config.pinned)

    @property
    def resident(self) -> bool:
        """Whether the current entry's workers serve (or will, once restarted) and it takes requests."""
        return self.entry.lifecycle.resident

    @property
    def removed(self) -> bool:
        """Whether its directory left the repository: out of the engine's table, it takes no new request."""
        return self.lifecycle.removed

    def residency(self) -> Residency:
        """Where the model is now, as users see it."""
        return self.lifecycle.residency(self.entry.lifecycle, self.loader is not None and not self.loader.done())

    def serve(self, entry: Entry) -> Entry:
        """A load made `entry` this model's version: new requests go to it from now on. Returns the
        entry it replaces (the same one when a load at start loads the entry in place)."""
        self.lifecycle.loaded()
        previous, self.entry = self.entry, entry
        return previous

    def begin_eviction(self) -> None:
        """Its workers are about to stop to free memory: until `end_eviction`, a request for it
        waits for the eviction (`eviction_ended`), then for its load."""
        self.lifecycle.evicting_now()
        self._eviction = asyncio.get_running_loop().create_future()

    def end_eviction(self) -> None:
        """The eviction ended (its workers stopped, or stopping failed): its waiters go on."""
        ended, self._eviction = self._eviction, None
        self.lifecycle.evicted()
        if ended is not None:
            ended.set_result(None)

    def eviction_ended(self) -> asyncio.Future[None] | None:
        """What a load waits for before it starts while the model is being evicted (None: it is not)."""
        return self._eviction

    def busy(self) -> bool:
        """Whether anything is queued, running or waiting for this model (it must not be evicted)."""
        if self.waiting or self.profiling or self.lock.locked():
            return True
        scheduler = getattr(self.entry, "scheduler", None)
        return scheduler is not None and (scheduler.queue_depth > 0 or scheduler.running_rows > 0)

    def used(self) -> None:
        """A request for this model arrived."""
        self.last_used_at = time.time()

    def idle_s(self, now: float) -> float:
        """Seconds it has gone without a request at wall clock `now`, counted from its last request
        or from the load that made it resident, whichever came later: a load that took longer than
        `idle_unload_s` was otherwise evicted the moment it ended, before the request that asked
        for it (refused `model_loading`) came back for it. 0 while no request ever asked for it."""
        if self.last_used_at is None:
            return 0.0
        return now - max(self.last_used_at, self.resident_at or 0.0)


def is_pipeline(slot: ModelSlot) -> bool:
    """Whether the slot holds a pipeline (no memory, never loaded by the pool)."""
    config = slot.entry.config
    return config is not None and config.kind == "pipeline"
