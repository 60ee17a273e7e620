"""The engine the API talks to: every model of one repository behind `ServingEngine`.

Requests resolve a model once (`resolve`) and then use the handle they got; the handle
follows a reload to the new version, so a request decoded while traffic moves is queued on
the version that serves it, never refused by the one that drains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig
from servewell.engine.admin_ops import EngineAdmin
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
from servewell.engine.entry import Entry, InvalidModel, not_ready
from servewell.engine.full_lanes import FullLaneBoard
from servewell.engine.memory_budget import MemoryBudget, listed_estimate, machine_memory_budget
from servewell.engine.model_entry import EntryServices, LoadProgressFn, ModelEntry
from servewell.engine.model_handle import LocalModel
from servewell.engine.model_pool import ModelPool, PoolSettings
from servewell.engine.model_slot import ModelSlot
from servewell.engine.pipeline import PipelineEntry, recheck_pipelines
from servewell.engine.protocol import ModelView, Readiness, RequestResult
from servewell.engine.readiness import ReadinessPolicy, evaluate_readiness
from servewell.engine.removals import RemovalWatch
from servewell.engine.repository import ModelSource, OutsidePolicy, read_model_config, scan_repository
from servewell.engine.request import InferenceRequest
from servewell.engine.response_cache import ResponseCache
from servewell.engine.snapshot import SnapshotStore
from servewell.engine.stream import PartSink
from servewell.engine.tenants import Tenants
from servewell.engine.versions import candidate_entries, judge_forever, stop_versions, sync_versions
from servewell.errors import Conflict, LoadFailed, NotFound, ShuttingDown, quote
from servewell.observability.metrics import ModelSample, ServeMetrics
from servewell.observability.signals import ModelFacts
from servewell.observability.tracing import Tracing
from servewell.workers.handle import WorkerSettings

log = logging.getLogger("servewell.engine")

#: Profile captures running at once across models (one per model): each costs its worker the
#: profiler's overhead and the frontend the trace's memory until it is sent.
MAX_PROFILE_CAPTURES = 2


class InferenceEngine(EngineAdmin):
    """All models of one repository (implements `ServingEngine`); the admin API's pool and
    rollout operations are `EngineAdmin`'s."""

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
        self._slots: dict[str, ModelSlot] = {}
        self.pool = ModelPool(pool or PoolSettings(), self._slots, self.budget, self._new_entry, metrics,
                              loaded=self._versions_of)
        self._removals = RemovalWatch(repository, self.pool)  # models and versions whose files are gone
        self.full_lanes = FullLaneBoard()  # whom full lanes refuse: the door tells the ingress processes
        self._services = EntryServices(load_timeout_s, self.budget, metrics, tracing, on_progress,
                                       workers=workers, snapshots=snapshots, repository=repository,
                                       outside_repository=models_outside_repository, make_room=self.pool.make_room,
                                       tenants=tenants, full_lanes=self.full_lanes)
        self.tenants = tenants
        self.tracing, self.metrics = tracing, metrics  # pipelines open a span per step and count their steps
        self._default_model = default_model
        self._first_load_locks: dict[str, asyncio.Lock] = {}  # names with a directory but no slot yet
        self._readiness_policy: ReadinessPolicy = readiness
        self._required_models = tuple(required_models)
        self.accepting = True
        self.draining = False  # shutting down: not ready, nothing restarts, requests still served
        self.payload_log: PayloadSink | None = None  # observability/payload_log.py: set by the server
        #: Every way into a model (engine/admission.py): one order of stages, one set of observers.
        self.chain = AdmissionChain(
            (ResolveModel(self), LoadIfNotResident(self), ChooseVersion(), ValidateInputs(), TenantQuota(tenants),
             CacheOrShare(), FitsDeadline(), Dispatch()),
            (TenantObserver(tenants, metrics), RolloutObserver(self.submit), PayloadObserver(lambda: self.payload_log)))
        self._judge: asyncio.Task[None] | None = None  # applies the rollout rules (engine/versions.py)

    async def start(self) -> None:
        """Read the repository and load every valid model (concurrently); in lazy mode only the
        pinned ones (the others load on their first request)."""
        for source in scan_repository(self.repository):
            self._add(source)
        unknown = [name for name in self._required_models if name not in self._slots]
        if self._readiness_policy == "required-models" and unknown:
            log.error("required models %s are not in the repository %s: the server stays not ready", unknown,
                      self.repository)
        self.pool.start(self._discover)
        if self.pool.lazy:
            log.info("lazy repository: %d models listed, %d pinned load now", len(self._slots),
                     sum(1 for s in self._slots.values() if s.pinned))
            await asyncio.gather(*(self.pool.acquire(s, None) for s in self._slots.values()
                                   if s.pinned and self.pool.loadable(s)), return_exceptions=True)
            await asyncio.gather(*(s.entry.load() for s in self._slots.values() if isinstance(s.entry, PipelineEntry)))
        else:
            await asyncio.gather(*(s.entry.load() for s in self._slots.values()))
        await asyncio.gather(*(self._sync_versions(s) for s in list(self._slots.values())))
        self._judge = asyncio.get_running_loop().create_task(judge_forever(self._slots))

    async def _sync_versions(self, slot: ModelSlot) -> None:
        async with slot.lock:
            await self._versions_of(slot)

    async def _versions_of(self, slot: ModelSlot) -> None:
        """Load the versions `slot`'s model.yaml names beside its stable one (`slot.lock` held)."""
        await sync_versions(slot, self._services, self.metrics)

    def _add(self, source: ModelSource) -> ModelSlot:
        entry: Entry
        estimated, never = listed_estimate(self.budget, source.name, source.directory, source.config)
        never = never if self.pool.lazy else None  # eager: its load fails, naming the same numbers
        if source.config is None or never is not None:
            entry = InvalidModel(source.name, source.directory, source.error or never or "invalid model.yaml")
        else:
            entry = self._build(source.name, source.directory, source.config)
        slot = self._slots[source.name] = ModelSlot(entry)
        slot.estimated_bytes = estimated
        return slot

    def _new_entry(self, name: str, config: ModelConfig) -> ModelEntry:
        return ModelEntry(name, self.repository / name, config, self._services)

    def _build(self, name: str, directory: Path, config: ModelConfig) -> ModelEntry | PipelineEntry:
        if config.kind == "pipeline":
            return PipelineEntry(name, directory, config, self._services, self)
        return ModelEntry(name, directory, config, self._services)

    async def _discover(self) -> list[str]:
        """Add the models whose directories appeared since the last scan, take an invalid
        model whose model.yaml is now valid, and take out the models and versions whose directories
        are gone (`remove_missing`) (lazy mode's poll). A new directory without a model.yaml yet is
        left for a later poll: it may be being copied in."""
        await self.remove_missing()
        known = {name for name, slot in self._slots.items() if slot.entry.state != "invalid"}
        sources = await asyncio.to_thread(scan_repository, self.repository, known)
        added = []
        for source in sources:
            slot = self._slots.get(source.name)
            if slot is None and source.config is None and not (source.directory / "model.yaml").is_file():
                continue
            if slot is not None and slot.entry.state == "invalid" and source.config is not None and \
                    slot.entry.reason == listed_estimate(self.budget, source.name, source.directory, source.config)[1]:
                continue  # still more than the whole memory budget: nothing new
            if slot is None or (slot.entry.state == "invalid" and source.config is not None):
                self._add(source)
                added.append(source.name)
        return added

    async def remove_missing(self, settle: bool = True) -> list[str]:
        """Take out every model, and every version of a traffic split, whose directory left the
        repository: no new request reaches it, those in flight finish (engine/removals.py).
        `settle` False (SIGHUP): what is gone now, not only what was gone at an earlier check too.
        Returns the names of the models taken out."""
        return await self._removals.sweep(self._slots, settle)

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
        model does not serve."""
        slot = self._slots.get(name)
        if slot is None or slot.removed:
            raise NotFound(f"unknown model {quote(name)}; this server has {sorted(self._slots)[:20]}")
        if version not in (None, "", slot.entry.version) and version not in self.other_versions(name):
            raise NotFound(f"model '{name}' has no version {quote(version)}; it serves "
                           f"{[slot.entry.version, *self.other_versions(name)]}")
        return slot

    @property
    def slots(self) -> Mapping[str, ModelSlot]:
        """Every model name's slot (pipelines read their step models' configs from them)."""
        return self._slots

    def default_model_name(self) -> str:
        """The configured default model, else the only or first valid model."""
        if self._default_model is not None and self._default_model in self._slots:
            return self._default_model
        valid = [name for name, slot in self._slots.items() if slot.entry.state != "invalid"]
        if not valid:
            raise NotFound("the repository has no valid model")
        return valid[0]

    def knows(self, name: str) -> bool:
        """Whether `name` is a model of this server."""
        return name in self._slots

    # --- control plane ---------------------------------------------------------------------

    async def load_model(self, name: str, config: ModelConfig | None = None) -> ModelView:
        """(Re)load a model from its repository directory with zero failed requests: the new
        version loads and warms up while the old one serves; then traffic moves and the old drains.
        `config`: its model.yaml, already read and checked (read here when not given)."""
        if self.draining:
            raise ShuttingDown("the server is shutting down and loads no model")
        directory = self.repository / name
        if not _safe_name(name) or not directory.is_dir():
            raise NotFound(f"the repository has no model directory {quote(name)}")
        slot = self._slots.get(name)
        lock = slot.lock if slot is not None else self._first_load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if config is None:
                try:
                    config = read_model_config(directory)
                except ValueError as exc:
                    raise LoadFailed(str(exc)) from None
            fresh = self._build(name, directory, config)
            await fresh.load()
            if fresh.state != "ready":
                if self._slots.get(name) is None:
                    # A new model stays listed as failed, with its reason, as one that fails at start
                    # does: /healthz, the repository index and its 503s say why; a later load replaces it.
                    self._slots[name] = ModelSlot(fresh)
                raise LoadFailed(f"model '{name}' failed to load (the previous version, if any, keeps serving): "
                                 f"{fresh.reason}")
            slot = self._slots.get(name)
            if slot is None:
                self._slots[name] = ModelSlot(fresh)
            else:
                slot.unloaded_by_operator = slot.evicted = False
                old, slot.entry = slot.entry, fresh  # from here on, new requests go to the new version
                await old.stop("reloading", reason="replaced by a reload")  # drains what the old version had accepted
            await sync_versions(self._slots[name], self._services, self.metrics)
        await recheck_pipelines(self._slots, name)
        return fresh.view()

    async def unload_model(self, name: str) -> ModelView:
        """Stop serving a model: queued and running requests finish, then its workers stop."""
        slot = self.slot(name, None)
        async with slot.lock:
            entry = slot.entry
            slot.unloaded_by_operator = True  # lazy mode: no request loads it again until an operator does
            await entry.stop("unloading", "unloaded", "unloaded by an operator")
            await stop_versions(slot, "unloading")
            return self._view(slot, entry)

    async def profile(self, name: str, instance: int, seconds: float) -> bytes:
        """A Chrome/Perfetto trace of one instance's batches over `seconds` (one at a time per model)."""
        slot = self.slot(name, None)
        entry = slot.entry.ready_entry()
        if slot.profiling:
            raise Conflict(f"a profile of model '{name}' is already being captured; try again when it ends")
        running = sorted(n for n, s in self._slots.items() if s.profiling)
        if len(running) >= MAX_PROFILE_CAPTURES:
            raise Conflict(f"{len(running)} profile captures are running ({', '.join(running)}), the most at once; "
                           "try again when one ends")
        slot.profiling = True
        log.info("profiling model %s, instance %d, for %g s", name, instance, seconds, extra={"model": name})
        try:
            with tempfile.TemporaryDirectory(prefix="servewell-profile-") as directory:
                path = await entry.profile(instance, seconds, directory)
                return await asyncio.to_thread(Path(path).read_bytes)
        finally:
            slot.profiling = False

    def batching(self, name: str) -> dict[str, Any]:
        """Live batching settings of a model."""
        return self._valid(name).scheduler.limits.settings()

    def response_cache(self, name: str) -> ResponseCache | None:
        """The response cache of the version serving `name` (None: it has none)."""
        return self._valid(name).cache

    def update_batching(self, name: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change a model's batching settings while it serves (all or nothing; None: back to
        model.yaml's value). The change lasts until model.yaml next changes (the file then wins) or
        the server restarts. `Conflict` when the model is unloaded, failed or stopping."""
        return self._valid(name).update_batching(changes)

    async def reconfigure_model(self, name: str, config: ModelConfig) -> str:
        """Apply `config`, a changed `model.yaml` of a loaded model that the caller read and checked
        (off the event loop): live when only batching settings changed, else through a zero-failure
        reload. Returns what happened (for the log); a failed reload raises `LoadFailed` and the
        running version keeps serving unchanged."""
        slot = self.slot(name, None)
        async with slot.lock:
            entry = slot.entry
            if self.pool.loadable(slot) and entry.state == "unloaded" and config.kind == "model":
                directory = self.repository / name
                slot.estimated_bytes, never = listed_estimate(self.budget, name, directory, config)
                slot.entry = self._new_entry(name, config) if never is None else InvalidModel(name, directory, never)
                await entry.release_snapshot()  # an eviction kept it for a reload of the old config
                if never is not None:
                    return f"refused: {never}"
                return "recorded: the model is not resident and loads with it on its next request"
            if entry.state == "unloaded":
                return "not applied: the model was unloaded by an operator (load it through the repository API)"
            if entry.state in ("ready", "restarting") and config == entry.config:
                return "unchanged"
            pipeline = isinstance(entry, PipelineEntry) or config.kind == "pipeline"  # reloads: a check, no worker
            if entry.state == "ready" and not pipeline and (serving := entry.ready_entry()).live_changes_only(config):
                dropped = serving.apply_batching(config)
                await sync_versions(slot, self._services, self.metrics)
                return "applied live" + (f"; admin overrides {sorted(dropped)} replaced by the file" if dropped else "")
        await self.load_model(name, config)
        if config.kind == "pipeline":
            return "reloaded (the pipeline's steps checked again)"
        return "reloaded (new workers warmed up before traffic moved)"

    def config_report(self) -> dict[str, Any]:
        """Per model: the active config, when it was read, and admin overrides in force."""
        return {name: slot.entry.report() for name, slot in self._slots.items()}

    def begin_shutdown(self) -> None:
        """Readiness turns false now and no worker is restarted from now on; requests are still
        admitted and served (a load balancer may send some until it notices)."""
        self.draining = True
        self.pool.stop()
        for entry in [s.entry for s in self._slots.values()] + candidate_entries(self._slots.values()):
            entry.close()

    def abort(self, why: str) -> None:
        """Stop admitting, and answer every queued and running request now with 503 shutting_down
        (the drain ran out of time, or a second signal said so)."""
        self.draining, self.accepting = True, False
        for entry in [s.entry for s in self._slots.values()] + candidate_entries(self._slots.values()):
            entry.fail_all(ShuttingDown(f"the server is shutting down: {why}"))

    async def stop(self, worker_timeout_s: float = 5.0) -> None:
        """Stop admitting, finish what was admitted, stop every worker (each gets `worker_timeout_s`
        to finish its batch; 0 kills them at once)."""
        self.begin_shutdown()
        self.accepting = False
        self.pool.stop()
        if self._judge is not None:
            self._judge.cancel()
        await asyncio.gather(*(s.entry.stop("shutting_down", worker_timeout_s=worker_timeout_s)
                               for s in self._slots.values()),
                             *(stop_versions(s, "shutting_down", worker_timeout_s) for s in self._slots.values()))

    # --- queries ---------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the server should receive traffic, by its readiness policy."""
        return self.readiness().ready

    @property
    def readiness_policy(self) -> str:
        """The readiness policy in force."""
        return self._readiness_policy

    def readiness(self) -> Readiness:
        """The readiness verdict, with its reason (`engine/readiness.py`)."""
        states = [(name, self.pool.readiness_state(slot)) for name, slot in self._slots.items()]
        return evaluate_readiness(self._readiness_policy, self._required_models, states,
                                  self.accepting and not self.draining)

    async def readiness_async(self) -> Readiness:
        """`readiness` (an ingress's engine asks the engine process when its table says not ready)."""
        return self.readiness()

    @property
    def memory_budget(self) -> tuple[int, int]:
        """(total, reserved) bytes."""
        return self.budget.total_bytes, self.budget.used_bytes

    def models(self) -> list[ModelView]:
        """Every model of the repository, valid or not."""
        return [self._view(s) for s in list(self._slots.values())]

    def model(self, name: str, version: str | None = None) -> ModelView:
        """One model; `NotFound` for an unknown name or version."""
        return self._view(self.slot(name, version))

    def _view(self, slot: ModelSlot, entry: Entry | None = None) -> ModelView:
        pool = getattr(entry or slot.entry, "pool", None)
        breakdown = pool.last_start_breakdown if pool is not None else None
        rollout = slot.rollout
        return dataclasses.replace(
            (entry or slot.entry).view(), last_start=breakdown.as_dict() if breakdown is not None else None,
            versions=tuple(rollout.versions()) if rollout is not None else (),
            rollout=rollout.to_json() if rollout is not None else None,
            residency=slot.residency(), pinned=slot.pinned,
            last_used_at=slot.last_used_at, estimated_bytes=slot.estimated_bytes, loadable=self.pool.loadable(slot),
            cold_starts=slot.cold_starts, evictions=slot.evictions, measured_bytes=slot.measured_bytes,
            budget_bytes=self.budget.held_bytes(entry or slot.entry))

    def loadable(self, name: str) -> bool:
        """Whether a request for `name` would load it now (lazy mode)."""
        slot = self._slots.get(name)
        return slot is not None and self.pool.loadable(slot)

    def table_key(self) -> tuple[Any, ...]:
        """What the door's model table reads (`engine/door.py`), cheaply: equal keys, equal tables,
        so its 50 ms poll builds no summaries nor readiness verdict while nothing changes."""
        pool = self.pool
        return (self.accepting, self.draining, self._readiness_policy, self._required_models, self._default_model,
                tuple((name, slot.entry.version, slot.entry.state, slot.entry.reason, id(slot.entry.config),
                       pool.loadable(slot), pool.readiness_state(slot), self.other_versions(name),
                       _live_batching(slot.entry))
                      for name, slot in self._slots.items()))

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

    def samples(self) -> list[ModelSample]:
        """State of every model for the metrics scrape (with the pool's facts from its slot, as `_view`)."""
        return [dataclasses.replace(slot.entry.sample(), residency=slot.residency(), pinned=slot.pinned,
                                    last_used_at=slot.last_used_at, estimated_bytes=slot.estimated_bytes)
                for slot in list(self._slots.values())]

    def model_facts(self) -> list[ModelFacts]:
        """Per-model facts the alert webhook evaluates (queue fill, restarts, memory headroom, and the
        rollback its rollout stands in)."""
        facts = [(slot, slot.entry.facts()) for slot in list(self._slots.values())]
        return [f if s.rollout is None else dataclasses.replace(f, rollback=s.rollout.alert_reason())
                for s, f in facts if f is not None]

    # --- lookups ---------------------------------------------------------------------------

    def _valid(self, name: str) -> ModelEntry:
        return self.slot(name, None).entry.configurable()


def _safe_name(name: str) -> bool:
    """A model name that can only be a directory directly under the repository (and not too long
    for a file name)."""
    return 0 < len(name) <= 200 and not name.startswith(".") and all(c.isalnum() or c in "-_." for c in name)


def _live_batching(entry: Entry) -> object:
    """The batching settings in force for `entry` (None without a scheduler): part of the table's key."""
    scheduler = getattr(entry, "scheduler", None)
    return scheduler.limits.batching if scheduler is not None else None
