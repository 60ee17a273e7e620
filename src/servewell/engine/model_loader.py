"""Changing which version of each model serves (`ModelLoader`): the repository loaded at start, a
model loaded or reloaded with zero failed requests (the new version loads and warms up while the
old one serves; then traffic moves and the old one drains), a changed model.yaml applied live or
through such a reload, an operator's unload, preload and evict, and every version stopped at
shutdown. Each change of a model holds its slot's lock, so one happens at a time per model.
"""

from __future__ import annotations

import asyncio
import logging
import time

from servewell.config.model import ModelConfig
from servewell.engine.engine_views import EngineViews
from servewell.engine.entry import Entry, InvalidModel
from servewell.engine.memory_budget import MemoryBudget, listed_estimate
from servewell.engine.model_entry import EntryServices
from servewell.engine.model_lifecycle import VersionPhase
from servewell.engine.model_pool import ModelPool
from servewell.engine.model_registry import ModelRegistry
from servewell.engine.model_slot import ModelSlot
from servewell.engine.pipeline import PipelineEntry, recheck_pipelines
from servewell.engine.protocol import ModelView
from servewell.engine.repository import read_model_config, scan_repository
from servewell.engine.serving_gate import ServingGate
from servewell.engine.versions import candidate_entries, stop_versions, sync_versions
from servewell.errors import LoadFailed, NotFound, ServeError, ShuttingDown, quote
from servewell.observability.metrics import ServeMetrics

log = logging.getLogger("servewell.engine")


class ModelLoader:
    """Loads, reloads, reconfigures, unloads, preloads and evicts the registry's models, and stops
    them all at shutdown."""

    def __init__(self, registry: ModelRegistry, pool: ModelPool, budget: MemoryBudget, services: EntryServices,
                 gate: ServingGate, views: EngineViews, metrics: ServeMetrics | None = None) -> None:
        self._registry = registry
        self._pool = pool
        self._budget = budget
        self._services = services
        self._gate = gate
        self._views = views  # what a change returns: the model's view after it
        self._metrics = metrics

    async def start(self) -> None:
        """Read the repository and load every valid model (concurrently); in lazy mode only the
        pinned ones and the pipelines (the others load on their first request)."""
        registry, pool, gate = self._registry, self._pool, self._gate
        for source in scan_repository(registry.repository):
            registry.add(source)
        unknown = [name for name in gate.required if not registry.knows(name)]
        if gate.policy == "required-models" and unknown:
            log.error("required models %s are not in the repository %s: the server stays not ready", unknown,
                      registry.repository)
        pool.start(registry.discover)
        slots = list(registry.slots.values())
        if pool.lazy:
            log.info("lazy repository: %d models listed, %d pinned load now", len(slots),
                     sum(1 for s in slots if s.pinned))
            await asyncio.gather(*(pool.acquire(s, None) for s in slots if s.pinned and pool.loadable(s)),
                                 return_exceptions=True)
            await self._load_in_place([s for s in slots if isinstance(s.entry, PipelineEntry)])
        else:
            await self._load_in_place([s for s in slots if s.entry.lifecycle.phase is not VersionPhase.INVALID])
        await asyncio.gather(*(self._sync_versions_locked(s) for s in list(registry.slots.values())))

    @staticmethod
    async def _load_in_place(slots: list[ModelSlot]) -> None:
        """Load the entry each slot was listed with (at start)."""
        for slot in slots:
            slot.serve(slot.entry)
        await asyncio.gather(*(slot.entry.load() for slot in slots))

    async def _sync_versions_locked(self, slot: ModelSlot) -> None:
        async with slot.lock:
            await sync_versions(slot, self._services, self._metrics)

    async def load_model(self, name: str, config: ModelConfig | None = None) -> ModelView:
        """(Re)load a model from its repository directory with zero failed requests: the new
        version loads and warms up while the old one serves; then traffic moves and the old drains.
        `config`: its model.yaml, already read and checked (read here when not given)."""
        if self._gate.draining:
            raise ShuttingDown("the server is shutting down and loads no model")
        registry = self._registry
        directory = registry.repository / name
        if not _safe_name(name) or not directory.is_dir():
            raise NotFound(f"the repository has no model directory {quote(name)}")
        async with registry.load_lock(name):
            if config is None:
                try:
                    config = read_model_config(directory)
                except ValueError as exc:
                    raise LoadFailed(str(exc)) from None
            fresh = registry.build(name, directory, config)
            await fresh.load()
            slot = registry.get(name)
            if not fresh.lifecycle.serving:
                if slot is None:
                    # A new model stays listed as failed, with its reason, as one that fails at start
                    # does: /healthz, the repository index and its 503s say why; a later load replaces it.
                    registry.put(name, fresh)
                raise LoadFailed(f"model '{name}' failed to load (the previous version, if any, keeps serving): "
                                 f"{fresh.reason}")
            if slot is None:
                slot = registry.put(name, fresh)
            else:
                old = slot.serve(fresh)  # from here on, new requests go to the new version
                await old.stop("reloading", "replaced by a reload")  # drains what the old version had accepted
            await sync_versions(slot, self._services, self._metrics)
        await recheck_pipelines(registry.slots, name)
        return fresh.view()

    async def unload_model(self, name: str) -> ModelView:
        """Stop serving a model: queued and running requests finish, then its workers stop; in lazy
        mode no request loads it again until an operator does."""
        slot = self._registry.slot(name, None)
        async with slot.lock:
            entry = slot.entry
            slot.lifecycle.unloaded()
            await entry.stop("unloading", "unloaded by an operator")
            await stop_versions(slot, "unloading")
            return self._views.view(slot, entry)

    async def reconfigure_model(self, name: str, config: ModelConfig) -> str:
        """Apply `config`, a changed `model.yaml` of a loaded model that the caller read and checked
        (off the event loop): live when only batching settings changed, else through a zero-failure
        reload. Returns what happened (for the log); a failed reload raises `LoadFailed` and the
        running version keeps serving unchanged."""
        slot = self._registry.slot(name, None)
        async with slot.lock:
            entry = slot.entry
            if self._pool.loadable(slot) and entry.state == "unloaded" and config.kind == "model":
                directory = self._registry.repository / name
                slot.estimated_bytes, never = listed_estimate(self._budget, name, directory, config)
                # Listed again, not loaded: its residency stays; its next request loads this config.
                slot.entry = self._registry.new_entry(name, config) if never is None else \
                    InvalidModel(name, directory, never)
                await entry.release_snapshot()  # an eviction kept it for a reload of the old config
                if never is not None:
                    return f"refused: {never}"
                return "recorded: the model is not resident and loads with it on its next request"
            if entry.state == "unloaded":
                return "not applied: the model was unloaded by an operator (load it through the repository API)"
            if entry.state in ("ready", "restarting") and config == entry.config:
                return "unchanged"
            pipeline = isinstance(entry, PipelineEntry) or config.kind == "pipeline"  # reloads: a check, no worker
            if entry.state == "ready" and not pipeline and \
                    (serving := entry.ready_entry()).settings.live_changes_only(config):
                dropped = serving.settings.apply_file(config)
                await sync_versions(slot, self._services, self._metrics)
                return "applied live" + (f"; admin overrides {sorted(dropped)} replaced by the file" if dropped else "")
        await self.load_model(name, config)
        if config.kind == "pipeline":
            return "reloaded (the pipeline's steps checked again)"
        return "reloaded (new workers warmed up before traffic moved)"

    async def preload(self, name: str) -> ModelView:
        """Load `name` now if it is not resident (lazy mode; evicts idle models to make room)."""
        slot = self._registry.slot(name, None)
        if not slot.resident:
            if not self._pool.loadable(slot):
                return await self.load_model(name)
            await self._pool.acquire(slot, time.monotonic() + self._services.load_timeout_s + 60)
        return self._views.view(slot)

    async def evict(self, name: str) -> ModelView:
        """Unload `name` now to free its memory (`Conflict` when pinned, busy or not resident); in
        lazy mode its next request loads it again."""
        slot = self._registry.slot(name, None)
        await self._pool.memory.evict(slot)
        return self._views.view(slot)

    # --- shutdown ------------------------------------------------------------------------------

    def _every_version(self) -> list[Entry]:
        slots = list(self._registry.slots.values())
        return [s.entry for s in slots] + list(candidate_entries(slots))

    def close_all(self) -> None:
        """Restart no worker of any version from now on (the server is shutting down)."""
        for entry in self._every_version():
            entry.close()

    def fail_all(self, error: ServeError) -> None:
        """Answer every queued and running request of every version with `error` now."""
        for entry in self._every_version():
            entry.fail_all(error)

    async def stop_all(self, worker_timeout_s: float) -> None:
        """Drain and stop every version (each worker gets `worker_timeout_s` to finish its batch)."""
        slots = list(self._registry.slots.values())
        await asyncio.gather(*(s.entry.stop("shutting_down", worker_timeout_s=worker_timeout_s) for s in slots),
                             *(stop_versions(s, "shutting_down", worker_timeout_s) for s in slots))


def _safe_name(name: str) -> bool:
    """A model name that can only be a directory directly under the repository (and not too long
    for a file name)."""
    return 0 < len(name) <= 200 and not name.startswith(".") and all(c.isalnum() or c in "-_." for c in name)

