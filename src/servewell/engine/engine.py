"""The engine the API talks to: every model of one repository behind `ServingEngine`.

Requests resolve a model once (`resolve_now`) and are then submitted whole (`submit`) to the one
admission chain (engine/admission.py); the model's slot follows a reload to the new version, so a
request decoded while traffic moves is queued on the version that serves it, never refused by the
one that drains.

`InferenceEngine` is the composition root of the engine's parts, each with one job:
- `registry` (engine/model_registry.py): which models the repository has, found by name;
- `pool` (engine/model_pool.py, with engine/pool_memory.py): lazy loads, and keeping the loaded
  models within the memory budget;
- `loader` (engine/model_loader.py): loads, reloads, unloads, preloads, evicts and stops them;
- `admin` (engine/admin_ops.py): what an operator changes on a serving model;
- `views` (engine/engine_views.py): what the engine shows of its models;
- `gate` (engine/serving_gate.py): whether it takes requests and traffic (shutdown and readiness).
A model's own lifecycle (residency, serving, rollout phase) is engine/model_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from servewell.engine.admin_ops import ModelAdmin
from servewell.engine.admission import (
    AdmissionChain,
    CacheOrShare,
    ChooseVersion,
    Dispatch,
    FitsDeadline,
    LoadIfNotResident,
    ResolveModel,
    TenantQuota,
    ValidateInputs,
)
from servewell.engine.admission_observers import PayloadObserver, PayloadSink, RolloutObserver, TenantObserver
from servewell.engine.engine_views import EngineViews
from servewell.engine.full_lanes import FullLaneBoard
from servewell.engine.memory_budget import MemoryBudget, machine_memory_budget
from servewell.engine.model_entry import EntryServices, LoadProgressFn
from servewell.engine.model_handle import LocalModel
from servewell.engine.model_lifecycle import not_ready
from servewell.engine.model_loader import ModelLoader
from servewell.engine.model_pool import ModelPool, PoolSettings
from servewell.engine.model_registry import ModelRegistry
from servewell.engine.model_slot import ModelSlot
from servewell.engine.pool_memory import PoolMemory
from servewell.engine.protocol import Readiness, RequestResult
from servewell.engine.readiness import ReadinessPolicy
from servewell.engine.repository import OutsidePolicy
from servewell.engine.request import InferenceRequest
from servewell.engine.serving_gate import ServingGate
from servewell.engine.snapshot import SnapshotStore
from servewell.engine.stream import PartSink
from servewell.engine.tenants import Tenants
from servewell.engine.versions import judge_forever, sync_versions
from servewell.errors import ShuttingDown
from servewell.observability.metrics import ServeMetrics
from servewell.observability.tracing import Tracing
from servewell.workers.handle import WorkerSettings

log = logging.getLogger("servewell.engine")


class InferenceEngine:
    """All models of one repository (implements `ServingEngine`): the data plane's way in, the
    engine's start and shutdown, and its parts (see the module)."""

    def __init__(
        self,
        repository: Path,
        load_timeout_s: float,
        on_progress: LoadProgressFn | None = None,
        memory_budget_bytes: int | None = None,
        metrics: ServeMetrics | None = None,
        tracing: Tracing | None = None,
        default_model: str | None = None,
        *,
        workers: WorkerSettings | None = None,
        snapshots: SnapshotStore | None = None,
        readiness: ReadinessPolicy = "any",
        required_models: Sequence[str] = (),
        models_outside_repository: OutsidePolicy = "warn",
        pool: PoolSettings | None = None,
        device_memory_budget_bytes: int | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.repository = repository
        self.budget = MemoryBudget(memory_budget_bytes or machine_memory_budget(), device_memory_budget_bytes)
        settings = pool or PoolSettings()
        slots: dict[str, ModelSlot] = {}  # written by the registry only; the pool and its memory read them
        memory = PoolMemory(slots, self.budget, settings.lazy, settings.idle_unload_of, metrics)
        self.full_lanes = FullLaneBoard()  # whom full lanes refuse: the door tells the ingress processes
        services = EntryServices(load_timeout_s, self.budget, metrics, tracing, on_progress,
                                 workers=workers, snapshots=snapshots, repository=repository,
                                 outside_repository=models_outside_repository, make_room=memory.make_room,
                                 tenants=tenants, full_lanes=self.full_lanes)
        self.registry = ModelRegistry(repository, slots, self.budget, services, settings.lazy, default_model)
        #: A cold load follows the split as a load at start does: the versions its model.yaml names load with it.
        self.pool = ModelPool(settings, slots, self.budget, memory, self.registry.new_entry, metrics,
                              loaded=partial(sync_versions, services=services, metrics=metrics))
        self.gate = ServingGate(readiness, required_models,
                                lambda: [(name, self.pool.readiness_state(slot)) for name, slot in slots.items()])
        self.views = EngineViews(self.registry, self.pool, self.budget, self.gate)
        self.loader = ModelLoader(self.registry, self.pool, self.budget, services, self.gate, self.views, metrics)
        self.admin = ModelAdmin(self.registry, self.views)
        self.tenants = tenants
        self.tracing, self.metrics = tracing, metrics
        self.payload_log: PayloadSink | None = None  # observability/payload_log.py: set by the server
        #: Every way into a model (engine/admission.py): one order of stages, one set of observers.
        self.chain = AdmissionChain(
            (ResolveModel(self), LoadIfNotResident(self), ChooseVersion(), ValidateInputs(), TenantQuota(tenants),
             CacheOrShare(), FitsDeadline(), Dispatch()),
            (TenantObserver(tenants, metrics), RolloutObserver(self.submit), PayloadObserver(lambda: self.payload_log)))
        self._judge: asyncio.Task[None] | None = None  # applies the rollout rules (engine/versions.py)

    async def start(self) -> None:
        """Read the repository and load every valid model (concurrently); in lazy mode only the
        pinned ones (the others load on their first request). Then the rollout rules run each second."""
        await self.loader.start()
        self._judge = asyncio.get_running_loop().create_task(judge_forever(self.registry.slots))

    # --- the data plane's entry point -----------------------------------------------------

    def submit(self, request: InferenceRequest, *, coalesce: bool = False) -> asyncio.Future[RequestResult]:
        """Admit `request` through the admission chain (engine/admission.py): every way into a
        model (an ingress's envelope, the in-process data plane, a pipeline's step, a shadow copy)
        comes here. A refusal is raised at once; the future resolves with the answer."""
        return self.chain.submit(request, coalesce=coalesce)

    def submit_stream(self, request: InferenceRequest, parts: PartSink) -> asyncio.Future[RequestResult]:
        """`submit` for a stream: the same chain; a generative model's parts go to `parts` as they
        are made, and the future resolves when the stream ends (engine/stream.py)."""
        return self.chain.submit(request, parts=parts)

    async def resolve_async(self, name: str, version: str | None = None) -> LocalModel:
        """Model `name` for a request about to be built (`NotFound` for an unknown name or version,
        `ShuttingDown` while draining). Nothing loads here: a model that is not resident loads when
        its request is submitted, in the chain."""
        return self.resolve_now(name, version)

    def resolve_now(self, name: str, version: str | None = None) -> LocalModel:
        """`resolve_async` (everything is known in this process)."""
        slot = self.slot(name, version)
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        config = slot.entry.config
        if config is None:
            raise not_ready(name, slot.entry.state, slot.entry.reason)
        return LocalModel(slot, self, config)

    def slot(self, name: str, version: str | None) -> ModelSlot:
        """The slot of model `name`; `NotFound` for an unknown (or removed) name, or a version the
        model does not serve (the admission chain resolves models through it)."""
        return self.registry.slot(name, version)

    def default_model_name(self) -> str:
        """The configured default model, else the only or first valid model."""
        return self.registry.default_model_name()

    def knows(self, name: str) -> bool:
        """Whether `name` is a model of this server: only such names become metric labels."""
        return self.registry.knows(name)

    # --- readiness and shutdown -------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """False once the server admits nothing new."""
        return self.gate.accepting

    @property
    def ready(self) -> bool:
        """Whether the server should receive traffic, by its readiness policy."""
        return self.gate.readiness().ready

    def readiness(self) -> Readiness:
        """The readiness verdict, with its reason (`engine/readiness.py`)."""
        return self.gate.readiness()

    async def readiness_async(self) -> Readiness:
        """`readiness` (an ingress's engine asks the engine process when its table says not ready)."""
        return self.gate.readiness()

    def begin_shutdown(self) -> None:
        """Readiness turns false now and no worker is restarted from now on; requests are still
        admitted and served (a load balancer may send some until it notices)."""
        self.gate.begin_drain()
        self.pool.stop()
        self.loader.close_all()

    def abort(self, why: str) -> None:
        """Stop admitting, and answer every queued and running request now with 503 shutting_down
        (the drain ran out of time, or a second signal said so)."""
        self.gate.close()
        self.loader.fail_all(ShuttingDown(f"the server is shutting down: {why}"))

    async def stop(self, worker_timeout_s: float = 5.0) -> None:
        """Stop admitting, finish what was admitted, stop every worker (each gets `worker_timeout_s`
        to finish its batch; 0 kills them at once)."""
        self.begin_shutdown()
        self.gate.close()
        if self._judge is not None:
            self._judge.cancel()
        await self.loader.stop_all(worker_timeout_s)
