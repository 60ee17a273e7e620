"""What runs after the admission chain decided (engine/admission.py): the canary judge and the
shadow, the payload log, and tenant attribution. Each sees every way into a model alike: a direct
request, a pipeline's step, a request that waited for a cold load; a shadow copy is seen by
tenant attribution only (its answer is compared, never returned nor judged)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from servewell.engine.admission import Admitting, Outcome
from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.errors import ServeError

if TYPE_CHECKING:
    from servewell.config.payload_log import PayloadLogConfig
    from servewell.engine.model_entry import ModelEntry
    from servewell.engine.rollout import Rollout
    from servewell.engine.tenants import Tenants
    from servewell.observability.metrics import ServeMetrics

log = logging.getLogger("servewell.engine")

#: The shadow's deadline: a copy that cannot finish in this long is dropped, not waited for.
SHADOW_TIMEOUT_S = 10.0

Submit = Callable[[InferenceRequest], Outcome]


class PayloadSink(Protocol):
    """What the engine calls of the payload log (observability/payload_log.py)."""

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


class RolloutObserver:
    """A model with other versions: the version that answered is named on its errors too (as
    `X-Model-Version`), every answer is reported to the canary judge while one is judged, and a
    share of the requests is copied to the shadow version once answered."""

    __slots__ = ("_submit",)

    def __init__(self, submit: Submit) -> None:
        self._submit = submit  # the chain's entry: a shadow copy is one more request

    def admitted(self, call: Admitting, outcome: Outcome) -> None:
        slot, entry = call.slot, call.entry
        if slot is None or entry is None or call.request.shadow:
            return
        rollout = slot.rollout
        if rollout is None:
            return
        if outcome.done():
            _name_version(entry.version, outcome)
        else:
            outcome.add_done_callback(partial(_name_version, entry.version))
        rollout.submitted(entry, outcome)
        version = rollout.shadow_for(entry)
        if version is not None:
            outcome.add_done_callback(partial(self._primary_done, rollout, version, call.request, entry))

    def refused(self, call: Admitting, error: ServeError) -> None:
        if call.entry is not None and call.slot is not None and call.slot.rollout is not None \
                and not error.model_version:
            error.model_version = call.entry.version

    def _primary_done(self, rollout: Rollout, version: str, request: InferenceRequest, primary: ModelEntry,
                      future: Outcome) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # nothing to compare with (the primary's own count says why)
        # After this loop step: the primary's answer is written back before the copy costs anything.
        asyncio.get_running_loop().call_later(0.0, self._copy, rollout, version, request, primary, future.result())

    def _copy(self, rollout: Rollout, version: str, request: InferenceRequest, primary: ModelEntry,
              answer: RequestResult) -> None:
        entry = rollout.shadow_room(version)
        if entry is None:
            return
        copy = request.shadow_copy(version, len(entry.scheduler.lanes) - 1, time.monotonic() + SHADOW_TIMEOUT_S)
        try:
            outcome = self._submit(copy)
        except ServeError:
            rollout.shadow_shed(version)
            return
        outcome.add_done_callback(partial(rollout.compare, version, answer, primary.config.max_batch_size > 0))


def _name_version(version: str, future: Outcome) -> None:
    """A done callback: the error `future` failed with, if any, names the version that answered it."""
    if not future.cancelled() and isinstance(error := future.exception(), ServeError) and not error.model_version:
        error.model_version = version


class PayloadObserver:
    """The payload log's sample of a model's requests (inputs, outputs or error, latency, tenant,
    the server's and the client's ids), recorded when each is answered."""

    __slots__ = ("_sink",)

    def __init__(self, sink: Callable[[], PayloadSink | None]) -> None:
        self._sink = sink  # read per request: the server sets (and replaces) the payload log while serving

    def admitted(self, call: Admitting, outcome: Outcome) -> None:
        sink = self._sink()
        request = call.request
        if sink is None or request.shadow or not sink.wants(request.model):
            return
        version = call.entry.version if call.entry is not None else (
            call.pipeline.version if call.pipeline is not None else "")
        outcome.add_done_callback(partial(_record, sink, version, request, time.monotonic()))

    def refused(self, call: Admitting, error: ServeError) -> None:
        """A refusal ran nothing: nothing to log."""


def _record(sink: PayloadSink, version: str, request: InferenceRequest, started: float, future: Outcome) -> None:
    if future.cancelled():
        return
    error = future.exception()
    result = future.result() if error is None else None
    sink.record(model=request.model, version=(result.version or version) if result is not None else version,
                tenant=request.tenant or None, request_id=request.id, inputs=dict(request.inputs),
                outputs=dict(result.outputs) if result is not None else None,
                latency_s=time.monotonic() - started, error=error, oip_id=request.client_id)


class TenantObserver:
    """Every request's outcome attributed to its tenant: a refusal (by any stage, or a full lane
    pushing it out later) or a failure is counted by tenant, model, lane and reason, and names the
    tenant on its error."""

    __slots__ = ("_tenants", "_metrics")

    def __init__(self, tenants: Tenants | None, metrics: ServeMetrics | None) -> None:
        self._tenants = tenants
        self._metrics = metrics

    def admitted(self, call: Admitting, outcome: Outcome) -> None:
        if call.request.counted:
            outcome.add_done_callback(partial(self._answered, call))

    def refused(self, call: Admitting, error: ServeError) -> None:
        if error.tenant is None:
            error.tenant = call.request.tenant
        if call.request.counted:
            self._count(call, error)

    def _answered(self, call: Admitting, future: Outcome) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if isinstance(error, ServeError):  # not named here: one error may answer a whole batch's tenants
            self._count(call, error)

    def _count(self, call: Admitting, error: ServeError) -> None:
        """One refused (429, 503) or failed request of the call's tenant. Only a model this server
        has becomes a label: a client naming an unknown one mints none."""
        if error.status in (429, 503):  # a refusal: counted in the metrics, which every process adds to
            if self._metrics is not None and call.slot is not None:
                self._metrics.count_refusal(call.request.model, _lane_name(call), call.request.tenant, error.code)
        elif self._tenants is not None and self._tenants.enabled:
            self._tenants.count_outcome(call.request.tenant, "failed")


def _lane_name(call: Admitting) -> str:
    entry = call.entry
    lanes = entry.scheduler.lanes if entry is not None else (
        call.pipeline.config.batching.lanes if call.pipeline is not None else ())
    lane = call.request.lane
    return lanes[lane] if 0 <= lane < len(lanes) else str(lane)
