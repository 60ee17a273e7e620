"""The admin API's operations on the model pool (pin, preload, evict) and on traffic splits
(read and change a model's weights and shadow), as a base of `InferenceEngine`."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from servewell.config.rollout import TrafficPatch
from servewell.engine.model_entry import EntryServices
from servewell.engine.model_pool import ModelPool
from servewell.engine.model_slot import ModelSlot
from servewell.engine.protocol import ModelView
from servewell.errors import Conflict, NotFound


class EngineAdmin:
    """What an operator changes while the engine serves; `InferenceEngine` provides the lookups."""

    pool: ModelPool
    _services: EntryServices
    if TYPE_CHECKING:  # InferenceEngine's lookups, declared for the type checker only
        def slot(self, name: str, version: str | None) -> ModelSlot: ...
        def _view(self, slot: ModelSlot) -> ModelView: ...
        def load_model(self, name: str) -> Awaitable[ModelView]: ...

    # --- the model pool ----------------------------------------------------------------------

    async def pin(self, name: str) -> ModelView:
        """Never evict `name` (until unpinned or the server restarts)."""
        slot = self.slot(name, None)
        slot.pinned_by_admin = True
        return self._view(slot)

    async def unpin(self, name: str) -> ModelView:
        """`name` may be evicted again (whatever its model.yaml says)."""
        slot = self.slot(name, None)
        slot.pinned_by_admin = False
        return self._view(slot)

    async def preload(self, name: str) -> ModelView:
        """Load `name` now if it is not resident (lazy mode; evicts idle models to make room)."""
        slot = self.slot(name, None)
        if not slot.resident:
            if not self.pool.loadable(slot):
                return await self.load_model(name)
            await self.pool.acquire(slot, time.monotonic() + self._services.load_timeout_s + 60)
        return self._view(slot)

    async def evict(self, name: str) -> ModelView:
        """Unload `name` now to free its memory (`Conflict` when pinned, busy or not resident); in
        lazy mode its next request loads it again."""
        slot = self.slot(name, None)
        await self.pool.evict(slot)
        return self._view(slot)

    def pool_report(self) -> dict[str, Any]:
        """The model pool as /healthz and the console show it."""
        return self.pool.report()

    # --- traffic splits ----------------------------------------------------------------------

    def rollout(self, name: str) -> dict[str, Any]:
        """A model's traffic split as GET /admin/models/{name}/rollout shows it (`NotFound`: none)."""
        rollout = self.slot(name, None).rollout
        if rollout is None:
            raise NotFound(f"model '{name}' splits no traffic (no traffic nor rollout in its model.yaml, or it is "
                           "not loaded)")
        return rollout.to_json()

    def update_rollout(self, name: str, patch: TrafficPatch) -> dict[str, Any]:
        """An admin's weights and/or shadow share, in force until model.yaml's traffic changes (the
        file then wins) or the server restarts. Clears a rollback or promotion verdict."""
        slot = self.slot(name, None)
        if slot.rollout is None:
            raise Conflict(f"model '{name}' splits no traffic: give it traffic (and versions under versions/) in "
                           "its model.yaml first")
        sent = patch.model_fields_set
        slot.rollout.set_by_admin(patch.traffic if "traffic" in sent else ...,
                                  patch.shadow_percent if "shadow_percent" in sent else ...)
        return slot.rollout.to_json()
