"""The models of one repository by name (`ModelRegistry`): the slot each name holds, the entry built
from its directory (a model, a pipeline, or an invalid one), the names that come and go with the
repository's directories, and every lookup the engine's other parts make by name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig
from servewell.engine.entry import Entry, InvalidModel
from servewell.engine.memory_budget import MemoryBudget, listed_estimate
from servewell.engine.model_entry import EntryServices, ModelEntry
from servewell.engine.model_slot import ModelSlot
from servewell.engine.pipeline import PipelineEntry
from servewell.engine.removals import RemovalWatch
from servewell.engine.repository import ModelSource, scan_repository
from servewell.errors import NotFound, quote

log = logging.getLogger("servewell.engine")


class ModelRegistry:
    """Which models one repository has: each name's `ModelSlot`, built from its directory, found by
    name (404 for an unknown or removed name or version), added and taken out as its directories
    come and go."""

    def __init__(self, repository: Path, slots: dict[str, ModelSlot], budget: MemoryBudget, services: EntryServices,
                 lazy: bool, default_model: str | None = None) -> None:
        self.repository = repository
        self._slots = slots  # shared with the pool, which reads them; only the registry adds and removes
        self._budget = budget
        self._services = services
        self._lazy = lazy
        self.default_model = default_model  # the configured default (None: the first valid model)
        self._removals = RemovalWatch(repository)  # models and versions whose files are gone
        self._first_load_locks: dict[str, asyncio.Lock] = {}  # names with a directory but no slot yet

    @property
    def slots(self) -> Mapping[str, ModelSlot]:
        """Every model name's slot (pipelines read their step models' configs from them)."""
        return self._slots

    def add(self, source: ModelSource) -> ModelSlot:
        """List `source` under its name (replacing what was there): its entry unloaded, or invalid
        when its model.yaml cannot be used or, in lazy mode, its estimate alone exceeds the budget."""
        entry: Entry
        estimated, never = listed_estimate(self._budget, source.name, source.directory, source.config)
        never = never if self._lazy else None  # eager: its load fails, naming the same numbers
        if source.config is None or never is not None:
            entry = InvalidModel(source.name, source.directory, source.error or never or "invalid model.yaml")
        else:
            entry = self.build(source.name, source.directory, source.config)
        slot = self._slots[source.name] = ModelSlot(entry)
        slot.estimated_bytes = estimated
        return slot

    def put(self, name: str, entry: Entry) -> ModelSlot:
        """A new name whose first version an operator loaded (ready or failed: it stays listed with
        its reason, as one that fails at start does)."""
        slot = self._slots[name] = ModelSlot(entry)
        slot.serve(entry)
        return slot

    def new_entry(self, name: str, config: ModelConfig) -> ModelEntry:
        """A fresh, unloaded version of model `name` from its directory."""
        return ModelEntry(name, self.repository / name, config, self._services)

    def build(self, name: str, directory: Path, config: ModelConfig) -> ModelEntry | PipelineEntry:
        """A fresh, unloaded entry for `config`: a pipeline or a model version."""
        if config.kind == "pipeline":
            return PipelineEntry(name, directory, config, self._services, self._slots)
        return ModelEntry(name, directory, config, self._services)

    async def discover(self) -> list[str]:
        """Add the models whose directories appeared since the last scan, take an invalid model
        whose model.yaml is now valid, and take out the models and versions whose directories are
        gone (`remove_missing`) (lazy mode's poll). A new directory without a model.yaml yet is left
        for a later poll: it may be being copied in. Returns the names added."""
        await self.remove_missing()
        known = {name for name, slot in self._slots.items() if slot.entry.state != "invalid"}
        sources = await asyncio.to_thread(scan_repository, self.repository, known)
        added = []
        for source in sources:
            slot = self._slots.get(source.name)
            if slot is None and source.config is None and not (source.directory / "model.yaml").is_file():
                continue
            if slot is not None and slot.entry.state == "invalid" and source.config is not None and \
                    slot.entry.reason == listed_estimate(self._budget, source.name, source.directory,
                                                         source.config)[1]:
                continue  # still more than the whole memory budget: nothing new
            if slot is None or (slot.entry.state == "invalid" and source.config is not None):
                self.add(source)
                added.append(source.name)
        return added

    async def remove_missing(self, settle: bool = True) -> list[str]:
        """Take out every model, and every version of a traffic split, whose directory left the
        repository: no new request reaches it, those in flight finish (engine/removals.py).
        `settle` False (SIGHUP): what is gone now, not only what was gone at an earlier check too.
        Returns the names of the models taken out."""
        return await self._removals.sweep(self._slots, settle)

    def removed_recently(self) -> list[dict[str, Any]]:
        """The models and versions taken out most recently (/healthz's pool.removed)."""
        return list(self._removals.recent)

    def slot(self, name: str, version: str | None) -> ModelSlot:
        """The slot of model `name`; `NotFound` for an unknown (or removed) name, or a version the
        model does not serve."""
        slot = self._slots.get(name)
        if slot is None or slot.removed:
            raise NotFound(f"unknown model {quote(name)}; this server has {sorted(self._slots)[:20]}")
        if version not in (None, "", slot.entry.version) and version not in self.other_versions(name):
            raise NotFound(f"model '{name}' has no version {quote(version)}; it serves "
                           f"{[slot.entry.version, *self.other_versions(name)]}")
        return slot

    def get(self, name: str) -> ModelSlot | None:
        """The slot of `name`, if it has one."""
        return self._slots.get(name)

    def knows(self, name: str) -> bool:
        """Whether `name` is a model of this server (valid or not)."""
        return name in self._slots

    def default_model_name(self) -> str:
        """The configured default model, else the only or first valid model."""
        if self.default_model is not None and self.default_model in self._slots:
            return self.default_model
        valid = [name for name, slot in self._slots.items() if slot.entry.state != "invalid"]
        if not valid:
            raise NotFound("the repository has no valid model")
        return valid[0]

    def other_versions(self, name: str) -> tuple[str, ...]:
        """The versions `name` serves beside its stable one (a traffic split's), sorted; for a model
        not resident, those its model.yaml names (a request loads them with it)."""
        slot = self._slots.get(name)
        if slot is None:
            return ()
        if slot.rollout is not None:
            return tuple(sorted(slot.rollout.candidates))
        config = slot.entry.config
        return tuple(sorted(config.other_versions)) if config is not None and not slot.resident else ()

    def entries(self) -> list[Entry]:
        """Every model's current entry (name, version, state, reason, config), without building
        views: the door compares them every 50 ms, and a view reads each worker's memory."""
        return [slot.entry for slot in list(self._slots.values())]

    def configurable(self, name: str) -> ModelEntry:
        """The version of `name` whose settings may be read and changed (`NotFound`, or
        `ModelNotReady` / `Conflict` for a model with none: invalid, a pipeline)."""
        return self.slot(name, None).entry.configurable()

    def load_lock(self, name: str) -> asyncio.Lock:
        """The lock one load or unload of `name` holds (its slot's; a name without one yet gets its own)."""
        slot = self._slots.get(name)
        return slot.lock if slot is not None else self._first_load_locks.setdefault(name, asyncio.Lock())
