"""The admission chain: every way into a model passes through these stages, in this order.

    resolve the model → load it if not resident → choose the version → check the inputs →
    tenant quota → response cache or in-flight share → can it finish in time → queue (fair lane admission)

and, after the outcome, the chain's observers (the canary judge and the shadow, the payload log,
tenant attribution). A request from an ingress, an in-process request, a pipeline's step, a
shadow copy and a request that waits for a cold load all enter `AdmissionChain.submit` with one
`InferenceRequest`, so a policy added as a stage applies to every one of them.

Each stage is a small object with one decision. It is called with the request's `Admitting`
record and its own position, and either
- continues: returns `chain.proceed(call, at)` (the rest of the chain's future),
- answers: returns a future of its own (a cached answer) without proceeding,
- refuses: raises the `ServeError` that says why (named for the request's tenant), or
- waits: returns a future that proceeds once what it waits for is done (a model loading).

The chain is synchronous until a stage waits: a request whose model is resident is queued before
`submit` returns, with no task or extra loop turn (the hot path of every request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

from servewell.engine.entry import ready_entry_or_refusal
from servewell.engine.pipeline import PipelineEntry
from servewell.engine.protocol import RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.stream import PartSink
from servewell.engine.validation import check_inputs
from servewell.errors import DeadlineExceeded, NotFound, ServeError, ShuttingDown

if TYPE_CHECKING:
    from servewell.engine.model_entry import ModelEntry
    from servewell.engine.model_pool import ModelPool
    from servewell.engine.model_slot import ModelSlot
    from servewell.engine.tenants import Tenants

Outcome = asyncio.Future[RequestResult]


class Admitting:
    """What the chain learns about one request on its way in (the request itself never changes)."""

    __slots__ = ("request", "coalesce", "slot", "entry", "pipeline", "rows", "started", "parts")

    def __init__(self, request: InferenceRequest, coalesce: bool, parts: PartSink | None = None) -> None:
        self.request = request
        self.coalesce = coalesce  # a pipeline step: batches form when the loop step ends
        self.parts = parts  # a stream's: where a generative model's parts go as they are made (engine/stream.py)
        self.slot: ModelSlot | None = None
        self.entry: ModelEntry | None = None  # the version chosen to serve it
        self.pipeline: PipelineEntry | None = None  # set instead of `entry` for a pipeline
        self.rows = 0  # counted by `ValidateInputs`
        self.started = time.monotonic()

    @property
    def model_entry(self) -> ModelEntry:
        """The version chosen (after `ChooseVersion`; a pipeline has none)."""
        if self.entry is None:
            raise RuntimeError("no version was chosen for this request")
        return self.entry


class Stage(Protocol):
    """One decision of the chain (see the module docstring)."""

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        """Decide for `call`; `at` is this stage's position (proceed with `chain.proceed(call, at)`)."""
        ...


class Observer(Protocol):
    """Runs after the chain decided: on the outcome's future, or on the refusal."""

    def admitted(self, call: Admitting, outcome: Outcome) -> None:
        """`call` was answered or queued: `outcome` resolves with its result."""
        ...

    def refused(self, call: Admitting, error: ServeError) -> None:
        """A stage refused `call` with `error`."""
        ...


class ModelDirectory(Protocol):
    """What the chain asks of the engine: its models, whether it takes requests, its pool."""

    @property
    def accepting(self) -> bool:
        """False once the server admits nothing new."""
        ...

    @property
    def pool(self) -> ModelPool:
        """Lazy loads and residency."""
        ...

    def slot(self, name: str, version: str | None) -> ModelSlot:
        """The slot of model `name` (`NotFound` for an unknown name or version)."""
        ...


class AdmissionChain:
    """The stages and observers every request of one engine passes through."""

    __slots__ = ("stages", "observers")

    def __init__(self, stages: Sequence[Stage], observers: Sequence[Observer] = ()) -> None:
        self.stages = tuple(stages)
        self.observers = tuple(observers)

    @property
    def names(self) -> tuple[str, ...]:
        """The stages' names, in order (the architecture page's table is checked against them)."""
        return tuple(type(stage).__name__ for stage in self.stages)

    def submit(self, request: InferenceRequest, *, coalesce: bool = False, parts: PartSink | None = None) -> Outcome:
        """Admit `request` through every stage; its future resolves with the result or the
        `ServeError` a later stage or the model answered. A refusal is raised at once. A stream
        gives `parts`: a generative model's parts go there as they are made."""
        call = Admitting(request, coalesce, parts)
        try:
            outcome = self.proceed(call, -1)
        except ServeError as error:
            for observer in self.observers:
                observer.refused(call, error)
            raise
        for observer in self.observers:
            observer.admitted(call, outcome)
        return outcome

    def proceed(self, call: Admitting, at: int) -> Outcome:
        """Run the stages after position `at` for `call`."""
        return self.stages[at + 1](self, call, at + 1)


# --- the stages, in order ------------------------------------------------------------------------


class ResolveModel:
    """The model the request names (404 for an unknown model or version); refused while the
    server admits nothing new."""

    __slots__ = ("_models",)

    def __init__(self, models: ModelDirectory) -> None:
        self._models = models

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        request = call.request
        slot = self._models.slot(request.model, request.version)  # NotFound for an unknown or removed one
        if not self._models.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        call.slot = slot
        slot.used()
        self._models.pool.count(slot)
        return chain.proceed(call, at)


class LoadIfNotResident:
    """A model that is not resident (lazy mode: never loaded, or evicted) is loaded while the
    request waits, up to its deadline and `max_load_wait_ms` (503 `model_loading` past them)."""

    __slots__ = ("_models",)

    def __init__(self, models: ModelDirectory) -> None:
        self._models = models

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        slot = call.slot
        assert slot is not None
        pool = self._models.pool
        if slot.resident or not pool.loadable(slot):
            return chain.proceed(call, at)
        return asyncio.ensure_future(self._after_load(chain, call, at, slot, pool))

    async def _after_load(self, chain: AdmissionChain, call: Admitting, at: int, slot: ModelSlot,
                          pool: ModelPool) -> RequestResult:
        began = time.monotonic()
        await pool.acquire(slot, call.request.deadline_at)
        load_s = time.monotonic() - began  # the cold start this request waited for (`Server-Timing` load)
        if not self._models.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        result = await chain.proceed(call, at)
        return dataclasses.replace(result, load_s=result.load_s + load_s)


class ChooseVersion:
    """The version that serves: the one the request names, else one drawn by the traffic split
    (sticky by the request's route key or tenant); a model that takes no requests now says why."""

    __slots__ = ()

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        slot = call.slot
        assert slot is not None
        current = slot.entry
        if isinstance(current, PipelineEntry):
            current.check_open()
            call.pipeline = current
            return chain.proceed(call, at)
        entry = ready_entry_or_refusal(current)
        rollout = slot.rollout
        if rollout is not None:
            entry = rollout.choose(entry, call.request.version, call.request)
        elif call.request.version not in (None, "", entry.version):
            raise NotFound(f"model '{entry.name}' has no version '{call.request.version}'; it serves "
                           f"['{entry.version}']")
        call.entry = entry
        return chain.proceed(call, at)


class ValidateInputs:
    """The request's tensors against the declared inputs of the version (or pipeline) that
    serves it: names, dtypes, shapes, the batch's rows (422 otherwise)."""

    __slots__ = ()

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        config = call.pipeline.config if call.pipeline is not None else call.model_entry.config
        call.rows = check_inputs(config, call.request.inputs)
        return chain.proceed(call, at)


class TenantQuota:
    """The tenant's rate, concurrency and per-model queue quotas (429 `over_quota`), counted
    once per request a client sent: a pipeline's steps and shadow copies count in their parent."""

    __slots__ = ("_tenants",)

    def __init__(self, tenants: Tenants | None) -> None:
        self._tenants = tenants

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        tenants = self._tenants
        request = call.request
        if tenants is None or not request.counted or not tenants.enabled:
            return chain.proceed(call, at)
        policy = tenants.policy(request.tenant)
        queued = (call.entry.sequences or call.entry.scheduler).tenant_depth(policy.id) if call.entry is not None else 0
        tenants.admit(policy, queued, request.model)
        try:
            outcome = chain.proceed(call, at)
        except BaseException:
            tenants.release(policy.id, call.started)
            raise
        outcome.add_done_callback(partial(_release, tenants, policy.id, call.started))
        return outcome


def _release(tenants: Tenants, tenant: str, started: float, _: Outcome) -> None:
    tenants.release(tenant, started)


class CacheOrShare:
    """A deterministic model's response cache: a repeat is answered from it, an identical request
    in flight shares that computation (the tenant's own unless the model shares across tenants)."""

    __slots__ = ()

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        entry = call.entry
        cache = entry.cache if entry is not None else None
        if cache is None or call.request.shadow:
            return chain.proceed(call, at)
        assert entry is not None
        return cache.serve(call.request.inputs, call.request.deadline_at, lambda: chain.proceed(call, at),
                           entry.count_outcome(call.request.lane), call.request.tenant)


class FitsDeadline:
    """A request that could no longer finish in time is refused before it costs compute (503
    `deadline_exceeded`): its deadline passed, or less is left than a batch of the model takes."""

    __slots__ = ()

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        request = call.request
        now = time.monotonic()
        left = request.deadline_at - now
        if left <= 0:
            raise DeadlineExceeded(f"the request's deadline of {(request.deadline_at - request.arrived_at) * 1000:.0f}"
                                   " ms passed before it was queued", tenant=request.tenant)
        if call.entry is not None:
            needed = call.entry.scheduler.limits.predicted_compute_s(call.rows)
            if left <= needed:
                raise DeadlineExceeded(f"{left * 1000:.1f} ms were left of the request's deadline and a batch of "
                                       f"model '{request.model}' takes about {needed * 1000:.1f} ms: not started",
                                       tenant=request.tenant)
        return chain.proceed(call, at)


class Dispatch:
    """The last stage: a model's request is queued in its lane (fair lane admission: a full lane
    refuses the tenant holding most of it beyond its share, `engine/batch_queue.py`); a pipeline's
    request runs its steps, each a request of its own through this chain."""

    __slots__ = ()

    def __call__(self, chain: AdmissionChain, call: Admitting, at: int) -> Outcome:
        if call.pipeline is not None:
            return call.pipeline.run(chain, call.request, call.rows)
        entry = call.model_entry
        if entry.sequences is not None:  # a generative model: one sequence, continuous batching (engine/sequences.py)
            return entry.sequences.submit(call.request, call.rows, call.parts)
        return entry.scheduler.submit(call.request, call.rows, coalesce=call.coalesce)
