"""The engine the API talks to: model lookup, admission and inference, behind one small class.

Routes never see schedulers or workers; they call `InferenceEngine.submit` and read
`ModelView`s. The engine can therefore be faked in tests or moved behind another transport.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.model_entry import InstanceInfo, LoadProgressFn, ModelEntry, ModelState
from servewell.engine.memory_budget import MemoryBudget, machine_memory_budget
from servewell.engine.repository import read_model_config, scan_repository
from servewell.engine.scheduler import RequestResult, SchedulerStats
from servewell.engine.validation import check_inputs
from servewell.observability.metrics import ModelSample, ServeMetrics, WorkerSample
from servewell.observability.signals import ModelFacts
from servewell.observability.tracing import Tracing
from servewell.errors import LoadFailed, ModelNotReady, NotFound, ShuttingDown


@dataclass(slots=True, frozen=True)
class ModelView:
    """Read-only facts about a model for metadata, health and index endpoints."""

    name: str
    version: str
    state: ModelState
    reason: str | None
    config: ModelConfig | None
    load_s: float | None
    restarts: int
    recycles: int
    queue_depth: int
    instances: tuple[InstanceInfo, ...]
    lane_depths: dict[str, int]
    stats: SchedulerStats | None


class InferenceEngine:
    """All models of one repository."""

    def __init__(
        self,
        repository: Path,
        load_timeout_s: float,
        on_progress: LoadProgressFn | None = None,
        memory_budget_bytes: int | None = None,
        metrics: ServeMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.repository = repository
        self.metrics = metrics
        self.tracing = tracing
        self.budget = MemoryBudget(memory_budget_bytes or machine_memory_budget())
        self._load_timeout_s = load_timeout_s
        self._on_progress = on_progress
        self._entries: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._accepting = True

    async def start(self) -> None:
        """Read the repository and load every valid model (concurrently)."""
        for source in scan_repository(self.repository):
            self._entries[source.name] = self._new_entry(source.name, source.directory, source.config, source.error)
        await asyncio.gather(*(entry.load() for entry in self._entries.values()))

    def _new_entry(self, name: str, directory: Path, config: ModelConfig | None, error: str | None) -> ModelEntry:
        return ModelEntry(
            name, directory, config, error, self._load_timeout_s, self.budget, self._on_progress, self.metrics,
            self.tracing,
        )

    async def load_model(self, name: str) -> ModelView:
        """(Re)load a model from its repository directory with zero failed requests: the new
        version loads and warms up while the old one serves; then traffic moves and the old drains."""
        directory = self.repository / name
        if not name or "/" in name or name.startswith(".") or not directory.is_dir():
            raise NotFound(f"the repository {self.repository} has no model directory '{name}'")
        async with self._locks.setdefault(name, asyncio.Lock()):
            try:
                config = read_model_config(directory)
            except ValueError as exc:
                raise LoadFailed(str(exc)) from None
            fresh = self._new_entry(name, directory, config, None)
            await fresh.load()
            if fresh.state != "ready":
                raise LoadFailed(f"model '{name}' failed to load (the previous version, if any, keeps serving): "
                                 f"{fresh.reason}")
            old = self._entries.get(name)
            self._entries[name] = fresh  # from here on, new requests go to the new version
            if old is not None:
                await old.stop()  # drains what the old version had accepted
            return self._view(fresh)

    async def profile(self, name: str, instance: int, seconds: float) -> bytes:
        """A Chrome/Perfetto trace of one instance's batches over `seconds`."""
        entry = self._entry(name, None)
        if entry.state != "ready":
            raise ModelNotReady(f"model '{name}' is {entry.state}", retry_after_s=2.0)
        with tempfile.TemporaryDirectory(prefix="servewell-profile-") as directory:
            path = await entry.profile(instance, seconds, directory)
            return Path(path).read_bytes()

    async def unload_model(self, name: str) -> ModelView:
        """Stop serving a model: queued and running requests finish, then its workers stop."""
        entry = self._entry(name, None)
        async with self._locks.setdefault(name, asyncio.Lock()):
            await entry.stop()
            entry.state, entry.reason = "unloaded", "unloaded by an operator"
            return self._view(entry)

    async def stop(self) -> None:
        """Stop admitting, finish what was admitted, stop every worker."""
        self._accepting = False
        await asyncio.gather(*(entry.stop() for entry in self._entries.values()))

    # --- queries -------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """The frontend is up and answering."""
        return True

    @property
    def ready(self) -> bool:
        """Accepting requests, and every valid model is ready."""
        serving = [e for e in self._entries.values() if e.config is not None and e.state != "unloaded"]
        return self._accepting and bool(serving) and all(e.state == "ready" for e in serving)

    def models(self) -> list[ModelView]:
        """Every model of the repository, valid or not."""
        return [self._view(e) for e in self._entries.values()]

    def model(self, name: str, version: str | None = None) -> ModelView:
        """One model; `NotFound` for an unknown name or version."""
        return self._view(self._entry(name, version))

    def default_model_name(self) -> str:
        """The model `/predict` uses when the request names none: the only or the first valid model."""
        valid = [name for name, e in self._entries.items() if e.config is not None]
        if not valid:
            raise NotFound("the repository has no valid model")
        return "digits" if "digits" in valid else valid[0]

    # --- inference -----------------------------------------------------------------------

    def admit(self, name: str, version: str | None, lane: str | None) -> None:
        """Cheap checks before a request is decoded: known model, ready, lane not full."""
        entry = self._ready_entry(name, version)
        entry.scheduler.admit(lane)

    def submit(
        self,
        name: str,
        version: str | None,
        inputs: dict[str, np.ndarray],
        *,
        lane: str | None = None,
        timeout_ms: float | None = None,
        request_id: str = "",
        arrived_at: float | None = None,
    ) -> asyncio.Future[RequestResult]:
        """Validate and queue one request; the future resolves with its result or a `ServeError`.
        Cancelling the future drops the request if it has not run yet."""
        entry = self._ready_entry(name, version)
        rows = check_inputs(entry.config, inputs)
        return entry.scheduler.submit(inputs, rows, lane, timeout_ms, request_id, arrived_at)

    def _ready_entry(self, name: str, version: str | None) -> ModelEntry:
        entry = self._entry(name, version)
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        if entry.state != "ready" or entry.scheduler is None:
            retry = None if entry.state in ("failed", "invalid", "unloaded") else 2.0
            detail = f": {entry.reason}" if entry.reason else ""
            raise ModelNotReady(f"model '{name}' is {entry.state}{detail}", retry_after_s=retry or 5.0)
        return entry

    def batching(self, name: str) -> dict[str, Any]:
        """Live batching settings of a model."""
        return self._scheduler(name).settings()

    def update_batching(self, name: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change a model's batching settings while it serves; queued requests are kept."""
        scheduler = self._scheduler(name)
        scheduler.update(changes)
        return scheduler.settings()

    def _scheduler(self, name: str):  # noqa: ANN202 - ModelScheduler
        entry = self._entry(name, None)
        if entry.scheduler is None:
            raise ModelNotReady(f"model '{name}' is invalid: {entry.reason}", retry_after_s=None)
        return entry.scheduler

    def config_of(self, name: str, version: str | None = None) -> ModelConfig:
        """The valid config of a model (`NotFound` / `ModelNotReady` otherwise)."""
        entry = self._entry(name, version)
        if entry.config is None:
            raise ModelNotReady(f"model '{name}' is invalid: {entry.reason}", retry_after_s=None)
        return entry.config

    def _entry(self, name: str, version: str | None) -> ModelEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"unknown model '{name}'; this server has {sorted(self._entries)}")
        if version not in (None, "", entry.version):
            raise NotFound(f"model '{name}' has no version '{version}'; it serves version '{entry.version}'")
        return entry

    def samples(self) -> list[ModelSample]:
        """State of every model for the metrics scrape."""
        out = []
        for entry in list(self._entries.values()):
            scheduler = entry.scheduler
            out.append(ModelSample(
                entry.name, entry.state,
                scheduler.lane_depths() if scheduler else {},
                (scheduler.queue_depth + scheduler.running_rows) if scheduler else 0,
                scheduler.max_batch_size if scheduler else 0,
                tuple(WorkerSample(entry.name, i.instance, i.alive, i.pid) for i in entry.instances()),
            ))
        return out

    def model_facts(self) -> list[ModelFacts]:
        """Per-model facts the alert webhook evaluates (queue fill, restarts, memory headroom)."""
        facts = []
        for entry in list(self._entries.values()):
            if entry.config is None or entry.scheduler is None:
                continue
            depths = entry.scheduler.lane_depths().values()
            fill = max(depths, default=0) / entry.scheduler.batching.max_queue_size
            limit = entry.config.memory_limit_bytes
            rss = max((i.rss_bytes for i in entry.instances()), default=0)
            headroom = 1.0 - rss / limit if limit else None
            facts.append(ModelFacts(entry.name, fill, entry.restarts + entry.recycles, headroom))
        return facts

    @staticmethod
    def _view(entry: ModelEntry) -> ModelView:
        scheduler = entry.scheduler
        return ModelView(
            entry.name, entry.version, entry.state, entry.reason, entry.config, entry.load_s,
            entry.restarts, entry.recycles, scheduler.queue_depth if scheduler else 0, tuple(entry.instances()),
            scheduler.lane_depths() if scheduler else {}, replace(scheduler.stats) if scheduler else None,
        )
