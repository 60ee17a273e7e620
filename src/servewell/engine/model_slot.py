"""What the engine knows of one model name across its loads (`ModelSlot`): the entry that serves it
now (a reload or a lazy load swaps the entry, never the slot), its lock, its place in the model
pool (last use, pin, evictions, what it was measured to hold) and its traffic split.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Literal

from servewell.engine.entry import Entry

if TYPE_CHECKING:
    from servewell.config.model import ModelConfig
    from servewell.engine.rollout import Rollout

#: Where a model is, as /healthz, the repository index, the console and metrics show it.
Residency = Literal["resident", "loading", "evicted", "not_loaded", "failed", "invalid"]


class ModelSlot:
    """Where one model name's current entry lives; a reload or a lazy load swaps the entry, not
    the slot. Also what the pool knows of the name across loads: last use, pin, counts."""

    __slots__ = ("entry", "lock", "profiling", "last_used_at", "pinned_by_admin", "waiting", "loader",
                 "cold_starts", "evictions", "evicted", "unloaded_by_operator", "load_s", "estimated_bytes",
                 "wanted_at", "rollout", "eviction", "removed", "measured_bytes", "measured_config")

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.lock = asyncio.Lock()  # one load/unload of this model at a time
        self.profiling = False
        self.last_used_at: float | None = None  # wall clock of the last request (None: never used)
        self.pinned_by_admin: bool | None = None  # POST .../pin or /unpin; None: model.yaml's pinned
        self.waiting = 0  # requests waiting for this model's lazy load
        self.loader: asyncio.Task[None] | None = None
        self.cold_starts = 0
        self.evictions = 0
        self.evicted = False  # the last unload was an eviction (memory or idle)
        self.unloaded_by_operator = False  # the repository API unloaded it: no lazy load until it loads it
        self.load_s: float | None = None  # the last measured load (Retry-After of model_loading)
        self.estimated_bytes: int | None = None
        self.wanted_at = 0.0  # monotonic time a request last asked for this model's load
        self.rollout: Rollout | None = None  # its other versions and traffic split (engine/rollout.py)
        self.eviction: asyncio.Future[None] | None = None  # done when the eviction under way has ended
        self.removed = False  # its directory is gone: out of the engine's table, it takes no new request
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
        """Whether the current entry takes requests now."""
        entry = self.entry
        return entry.state in ("ready", "restarting") and getattr(entry, "stopping", None) is None

    def residency(self) -> Residency:
        """Where the model is now."""
        entry = self.entry
        if entry.state == "invalid":
            return "invalid"
        if self.resident:
            return "resident"
        if entry.state == "loading" or (self.loader is not None and not self.loader.done()):
            return "loading"
        if entry.state == "failed":
            return "failed"
        return "evicted" if self.evicted else "not_loaded"

    def busy(self) -> bool:
        """Whether anything is queued, running or waiting for this model (it must not be evicted)."""
        if self.waiting or self.profiling or self.lock.locked():
            return True
        scheduler = getattr(self.entry, "scheduler", None)
        return scheduler is not None and (scheduler.queue_depth > 0 or scheduler.running_rows > 0)

    def used(self) -> None:
        """A request for this model arrived."""
        self.last_used_at = time.time()


def is_pipeline(slot: ModelSlot) -> bool:
    """Whether the slot holds a pipeline (no memory, never loaded by the pool)."""
    config = slot.entry.config
    return config is not None and config.kind == "pipeline"
