"""A request's handle on a ready model (`ServedModelHandle`), and `ready_entry_or_refusal`: the
check every path that queues a request makes (engine/engine.py resolves names to handles)."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from servewell.config.model import ModelConfig
from servewell.config.payload_log import PayloadLogConfig
from servewell.engine.entry import Entry
from servewell.engine.lanes import resolve_lane
from servewell.engine.model_slot import ModelSlot
from servewell.engine.protocol import RequestResult
from servewell.engine.validation import check_inputs
from servewell.errors import NotFound, ServeError, ShuttingDown
from servewell.observability.context import client_var, oip_id_var

if TYPE_CHECKING:
    from servewell.engine.engine import InferenceEngine
    from servewell.engine.model_entry import ModelEntry


class ServedModelHandle:
    """A request's view of a ready model (`ServedModel`): admit and infer without lookups."""

    __slots__ = ("_slot", "_engine", "name", "config", "_lanes", "_version")

    def __init__(self, slot: ModelSlot, engine: InferenceEngine, entry: ModelEntry, version: str | None = None) -> None:
        self._slot = slot
        self._engine = engine
        self.name = entry.name
        self.config: ModelConfig = entry.config
        self._lanes = entry.scheduler.lanes
        self._version = version or None  # the version the request's path named (None: the traffic split draws)

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        """Lane index for a request's urgency and/or OIP priority (engine/lanes.py)."""
        return resolve_lane(self._lanes, urgency, priority)

    def _serving(self) -> ModelEntry:
        entry = self._slot.entry
        if self._slot.removed:
            raise NotFound(f"model '{self.name}' was removed from the repository")
        if not self._engine.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        return ready_entry_or_refusal(entry)

    def admit(self, lane: int) -> None:
        """Refuse now what could not be queued (not ready, lane full, shutting down)."""
        if not self._slot.resident and self._engine.pool.loadable(self._slot):
            return  # evicted since it resolved: `infer` loads it again
        tenants = self._engine.tenants
        tenant = tenants.of(client_var.get()).id if tenants is not None and tenants.enabled else ""
        self._serving().scheduler.admit(lane, tenant)

    def infer(self, inputs: dict[str, np.ndarray], *, lane: int, deadline: float | None, request_id: str,
              arrived_at: float | None) -> asyncio.Future[RequestResult]:
        """Validate and queue the request on the version serving now (`deadline`: absolute
        `time.monotonic()` seconds, None for the model's default timeout from `arrived_at`)."""
        future, version = self._submit(inputs, lane, deadline, request_id, arrived_at)
        payload = self._engine.payload_log
        if payload is not None and payload.wants(self.name):
            future.add_done_callback(partial(log_payload, payload, self.name, version, inputs, request_id,
                                             time.monotonic()))
        return future

    def _submit(self, inputs: dict[str, np.ndarray], lane: int, deadline: float | None, request_id: str,
                arrived_at: float | None) -> tuple[asyncio.Future[RequestResult], str]:
        """Queue the request; its future and the version it was queued on."""
        slot = self._slot
        slot.used()
        if not slot.resident and self._engine.pool.loadable(slot):
            # Evicted (or being evicted) since this request resolved it: load it again and queue there.
            check_inputs(self.config, inputs)
            return asyncio.ensure_future(self._engine.load_then_submit(slot, inputs, lane, deadline, request_id,
                                                                       arrived_at)), self.config.version
        entry = self._serving()
        rollout = slot.rollout
        if rollout is not None:
            entry = rollout.choose(entry, self._version)
        try:
            rows = check_inputs(entry.config, inputs)
            future = entry.submit(inputs, rows, lane, deadline, request_id, arrived_at)
        except ServeError as exc:
            if rollout is not None:
                answered_by(entry.version, exc)
            raise
        if rollout is not None:
            # A split's error answers say which version answered, as its successes do (issue 45 H10):
            # named before any waiter reads the error (callbacks run in the order they were added).
            if future.done():
                error_answered_by(entry.version, future)
            else:
                future.add_done_callback(partial(error_answered_by, entry.version))
            rollout.submitted(entry, future, inputs, rows, request_id)
        return future, entry.version


def answered_by(version: str, error: BaseException) -> None:
    """Name `version` as the one that answered with `error` (the first version named stays)."""
    if isinstance(error, ServeError) and not error.model_version:
        error.model_version = version


def error_answered_by(version: str, future: asyncio.Future[RequestResult]) -> None:
    """A done callback: the error `future` failed with, if any, names `version` (`answered_by`)."""
    if not future.cancelled() and (error := future.exception()) is not None:
        answered_by(version, error)


def ready_entry_or_refusal(entry: Entry) -> ModelEntry:
    """`entry` if it takes new requests; otherwise the error that says why (the model is not ready,
    or it is being unloaded or replaced: its own 503 code, never `shutting_down`)."""
    ready = entry.ready_entry()
    refusal = ready.refusal()
    if refusal is not None:
        raise refusal
    return ready


def log_payload(payload: PayloadSink, model: str, version: str, inputs: dict[str, np.ndarray], request_id: str,
                started: float, future: asyncio.Future[RequestResult]) -> None:
    """A done callback: hand a finished request to the payload log (observability/payload_log.py)."""
    if future.cancelled():
        return
    error = future.exception()
    result = future.result() if error is None else None
    payload.record(model=model, version=(result.version or version) if result is not None else version,
                   tenant=client_var.get() or None, request_id=request_id, inputs=inputs,
                   outputs=result.outputs if result is not None else None,
                   latency_s=time.monotonic() - started, error=error, oip_id=oip_id_var.get())


class PayloadSink(Protocol):
    """What the engine calls of the payload log."""

    def wants(self, model: str) -> bool:
        """Whether this request of `model` is sampled (cheap; called for every request)."""
        ...

    def record(self, *, model: str, version: str, tenant: str | None, request_id: str,
               inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray] | None, latency_s: float,
               error: BaseException | None, oip_id: str | None = None) -> None:
        """Take one finished request (never blocks, never raises); `oip_id`: the client's OIP id."""
        ...

    def apply(self, settings: PayloadLogConfig) -> None:
        """Take a changed `payload_log` section (live; `OSError` when a sink cannot be opened)."""
        ...
