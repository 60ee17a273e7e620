"""A request's handle on a ready model (`ServedModelHandle`), and `ready_entry_or_refusal`: the
check every path that queues a request makes (engine/engine.py resolves names to handles)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.entry import Entry
from servewell.engine.lanes import resolve_lane
from servewell.engine.model_pool import ModelSlot
from servewell.engine.protocol import RequestResult
from servewell.engine.validation import check_inputs
from servewell.errors import ShuttingDown

if TYPE_CHECKING:
    from servewell.engine.engine import InferenceEngine
    from servewell.engine.model_entry import ModelEntry


class ServedModelHandle:
    """A request's view of a ready model (`ServedModel`): admit and infer without lookups."""

    __slots__ = ("_slot", "_engine", "name", "config", "_lanes")

    def __init__(self, slot: ModelSlot, engine: InferenceEngine, entry: ModelEntry) -> None:
        self._slot = slot
        self._engine = engine
        self.name = entry.name
        self.config: ModelConfig = entry.config
        self._lanes = entry.scheduler.lanes

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        """Lane index for a request's urgency and/or OIP priority (engine/lanes.py)."""
        return resolve_lane(self._lanes, urgency, priority)

    def _serving(self) -> ModelEntry:
        entry = self._slot.entry
        if not self._engine.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        return ready_entry_or_refusal(entry)

    def admit(self, lane: int) -> None:
        """Refuse now what could not be queued (not ready, lane full, shutting down)."""
        if not self._slot.resident and self._engine.pool.loadable(self._slot):
            return  # evicted since it resolved: `infer` loads it again
        self._serving().scheduler.admit(lane)

    def infer(self, inputs: dict[str, np.ndarray], *, lane: int, deadline: float | None, request_id: str,
              arrived_at: float | None) -> asyncio.Future[RequestResult]:
        """Validate and queue the request on the version serving now (`deadline`: absolute
        `time.monotonic()` seconds, None for the model's default timeout from `arrived_at`)."""
        slot = self._slot
        slot.used()
        if not slot.resident and self._engine.pool.loadable(slot):
            # Evicted (or being evicted) since this request resolved it: load it again and queue there.
            check_inputs(self.config, inputs)
            return asyncio.ensure_future(self._engine.load_then_submit(slot, inputs, lane, deadline, request_id,
                                                                       arrived_at))
        entry = self._serving()
        rows = check_inputs(entry.config, inputs)
        return entry.submit(inputs, rows, lane, deadline, request_id, arrived_at)


def ready_entry_or_refusal(entry: Entry) -> ModelEntry:
    """`entry` if it takes new requests; otherwise the error that says why (the model is not ready,
    or it is being unloaded or replaced: its own 503 code, never `shutting_down`)."""
    ready = entry.ready_entry()
    refusal = ready.refusal()
    if refusal is not None:
        raise refusal
    return ready
