"""A model of this process's engine as a request's protocol code sees it before the request is
built (`LocalModel`, a `ServedModel`): its config to decode with, its lanes, and the cheap checks
that refuse a request before its body is read or decoded. The request itself then goes through
the admission chain (`InferenceEngine.submit`, engine/admission.py), the one way into a model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servewell.config.model import ModelConfig
from servewell.engine.entry import ready_entry_or_refusal
from servewell.engine.lanes import resolve_lane
from servewell.engine.model_slot import ModelSlot
from servewell.engine.promised import Promise
from servewell.errors import NotFound, ShuttingDown

if TYPE_CHECKING:
    from servewell.engine.engine import InferenceEngine


class LocalModel:
    """A model (or pipeline) of the engine in this process, resolved for one request."""

    __slots__ = ("_slot", "_engine", "name", "config", "_lanes")

    def __init__(self, slot: ModelSlot, engine: InferenceEngine, config: ModelConfig) -> None:
        self._slot = slot
        self._engine = engine
        self.name = slot.name
        self.config = config
        self._lanes = tuple(config.batching.lanes)

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        """Lane index for a request's urgency and/or OIP priority (engine/lanes.py)."""
        return resolve_lane(self._lanes, urgency, priority)

    @property
    def default_timeout_s(self) -> float:
        """The model's default request timeout, as in force now (an admin may have changed it live)."""
        scheduler = getattr(self._slot.entry, "scheduler", None)
        batching = scheduler.limits.batching if scheduler is not None else self.config.batching
        return batching.default_timeout_ms / 1000.0

    def admit(self, lane: int, tenant: str = "") -> Promise | None:
        """Refuse now what the admission chain would refuse at once: the server shutting down, the
        model removed or not taking requests, or a full lane that `tenant` holds most of beyond
        its share. A model that is not resident but loads on a request is admitted (it loads then)."""
        if not self._engine.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        slot = self._slot
        if slot.removed:
            raise NotFound(f"model '{self.name}' was removed from the repository")
        entry = slot.entry
        check_open = getattr(entry, "check_open", None)
        if check_open is not None:  # a pipeline: its steps are admitted one by one
            check_open()
            return None
        if not slot.resident and self._engine.pool.loadable(slot):
            return None
        return ready_entry_or_refusal(entry).scheduler.admit(lane, tenant)
