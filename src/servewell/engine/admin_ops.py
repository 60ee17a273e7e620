"""How an operator changes a serving model without loading or unloading it (`ModelAdmin`): its pin
in the model pool, its live batching settings, its response cache, its traffic split's weights and
shadow share, and a profile of one of its workers. Loads, unloads, preloads and evictions change
which version serves: engine/model_loader.py."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servewell.config.rollout import TrafficPatch
from servewell.engine.engine_views import EngineViews
from servewell.engine.model_registry import ModelRegistry
from servewell.engine.protocol import ModelView
from servewell.engine.response_cache import ResponseCache
from servewell.errors import Conflict, NotFound

log = logging.getLogger("servewell.engine")

#: Profile captures running at once across models (one per model): each costs its worker the
#: profiler's overhead and the frontend the trace's memory until it is sent.
MAX_PROFILE_CAPTURES = 2


class ModelAdmin:
    """What an operator changes on a model while it serves."""

    __slots__ = ("_registry", "_views")

    def __init__(self, registry: ModelRegistry, views: EngineViews) -> None:
        self._registry = registry
        self._views = views

    # --- the model pool ----------------------------------------------------------------------

    async def pin(self, name: str) -> ModelView:
        """Never evict `name` (until unpinned or the server restarts)."""
        slot = self._registry.slot(name, None)
        slot.pinned_by_admin = True
        return self._views.view(slot)

    async def unpin(self, name: str) -> ModelView:
        """`name` may be evicted again (whatever its model.yaml says)."""
        slot = self._registry.slot(name, None)
        slot.pinned_by_admin = False
        return self._views.view(slot)

    # --- batching and the response cache -----------------------------------------------------

    def batching(self, name: str) -> dict[str, Any]:
        """Live batching settings of a model."""
        return self._registry.configurable(name).scheduler.limits.settings()

    def update_batching(self, name: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change a model's batching settings while it serves (all or nothing; None: back to
        model.yaml's value). The change lasts until model.yaml next changes (the file then wins) or
        the server restarts. `Conflict` when the model is unloaded, failed or stopping."""
        return self._registry.configurable(name).settings.update_batching(changes)

    def response_cache(self, name: str) -> ResponseCache | None:
        """The response cache of the version serving `name` (None: it has none)."""
        return self._registry.configurable(name).cache

    # --- traffic splits ----------------------------------------------------------------------

    def rollout(self, name: str) -> dict[str, Any]:
        """A model's traffic split as GET /admin/models/{name}/rollout shows it (`NotFound`: none)."""
        rollout = self._registry.slot(name, None).rollout
        if rollout is None:
            raise NotFound(f"model '{name}' splits no traffic (no traffic nor rollout in its model.yaml, or it is "
                           "not loaded)")
        return rollout.to_json()

    def update_rollout(self, name: str, patch: TrafficPatch) -> dict[str, Any]:
        """An admin's weights and/or shadow share, in force until model.yaml's traffic changes (the
        file then wins) or the server restarts. Clears a rollback or promotion verdict."""
        slot = self._registry.slot(name, None)
        if slot.rollout is None:
            raise Conflict(f"model '{name}' splits no traffic: give it traffic (and versions under versions/) in "
                           "its model.yaml first")
        sent = patch.model_fields_set
        slot.rollout.set_by_admin(patch.traffic if "traffic" in sent else ...,
                                  patch.shadow_percent if "shadow_percent" in sent else ...)
        return slot.rollout.to_json()

    # --- profiling ---------------------------------------------------------------------------

    async def profile(self, name: str, instance: int, seconds: float) -> bytes:
        """A Chrome/Perfetto trace of one instance's batches over `seconds` (one at a time per model)."""
        slot = self._registry.slot(name, None)
        entry = slot.entry.ready_entry()
        if slot.profiling:
            raise Conflict(f"a profile of model '{name}' is already being captured; try again when it ends")
        running = sorted(n for n, s in self._registry.slots.items() if s.profiling)
        if len(running) >= MAX_PROFILE_CAPTURES:
            raise Conflict(f"{len(running)} profile captures are running ({', '.join(running)}), the most at once; "
                           "try again when one ends")
        slot.profiling = True
        log.info("profiling model %s, instance %d, for %g s", name, instance, seconds, extra={"model": name})
        try:
            with tempfile.TemporaryDirectory(prefix="servewell-profile-") as directory:
                path = await entry.pool.profile(instance, seconds, directory)
                return await asyncio.to_thread(Path(path).read_bytes)
        finally:
            slot.profiling = False
