"""The engine as the API layer sees it: a small typed boundary (`ServingEngine`, `ServedModel`).

Protocols (HTTP today, gRPC next) resolve a model once per request and then talk only to the
handle they got: admit, infer. Control-plane operations (load, unload, batching, profile, the
views for health, metadata and metrics) are typed messages of their own (engine/control.py),
answered by the engine's dispatch table, not methods of this boundary. Nothing here knows about
schedulers or worker processes, so the engine can be replaced by a fake in tests or moved
behind another transport.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from servewell.config.model import ModelConfig, TensorSpec
from servewell.engine.request import InferenceRequest

if TYPE_CHECKING:
    from servewell.engine.promised import Promise
    from servewell.engine.stream import PartSink

ModelState = Literal["loading", "ready", "restarting", "failed", "invalid", "unloaded"]


def client_shape(config: ModelConfig, spec: TensorSpec) -> list[int]:
    """The full shape of a tensor as a client sends or gets it: a batch dimension -1 first when the
    model batches, then the item shape (-1: any size)."""
    return ([-1] if config.max_batch_size > 0 else []) + list(spec.shape)


@dataclass(slots=True, frozen=True)
class StepTiming:
    """One step of a pipeline request (engine/pipeline.py): where its time went, or why it did not run."""

    step: str
    model: str
    queue_s: float
    compute_s: float
    total_s: float  # from its inputs being ready to its outputs
    batch_size: int
    outcome: str  # success or skipped

    def __reduce__(self) -> tuple[type[StepTiming], tuple[str, str, float, float, float, int, str]]:
        # A frozen slotted dataclass pickles through dataclasses.fields() per object: this is
        # several times cheaper, on every pipeline answer that crosses the door to an ingress.
        return (StepTiming, (self.step, self.model, self.queue_s, self.compute_s, self.total_s, self.batch_size,
                             self.outcome))


@dataclass(slots=True, frozen=True)
class RequestResult:
    """What a request gets back: its own rows of every output plus its timings."""

    outputs: dict[str, np.ndarray]
    queue_s: float  # a pipeline's: summed over the steps that ran
    compute_s: float
    batch_size: int
    cache: str = ""  # "hit" or "coalesced" when the response cache answered it (engine/response_cache.py)
    steps: tuple[StepTiming, ...] = ()  # a pipeline's steps, in its model.yaml's order
    version: str = ""  # the version that answered (a traffic split may choose another than the path named)
    load_s: float = 0.0  # time it waited for its model to load (a cold start, lazy mode; `Server-Timing` load)

    def __reduce__(self) -> tuple[type[RequestResult], tuple[Any, ...]]:
        # Pickled for every answer that crosses the door: see StepTiming.__reduce__.
        return (RequestResult, (self.outputs, self.queue_s, self.compute_s, self.batch_size, self.cache, self.steps,
                                self.version, self.load_s))


@dataclass(slots=True, frozen=True)
class InstanceInfo:
    """One worker process of a model, as health endpoints show it."""

    instance: int
    pid: int | None
    alive: bool
    rss_bytes: int
    rows_computed: int
    state: str = "ready"  # starting, queued (for a load slot), backoff (to retry a failed load), ready, hung
    # (killed, being replaced), exiting (not yet reaped), exited, stopped
    exit_reason: str = ""  # how the last process of this instance ended (exit code, signal, hung)
    load_attempt: int = 1  # which attempt at loading it the current worker is (workers/pool.py retries)
    next_attempt_at: float | None = None  # in state backoff: when the next attempt starts (Unix seconds)


@dataclass(slots=True, frozen=True)
class Readiness:
    """Whether the server should receive traffic, and why (`engine/readiness.py` decides)."""

    ready: bool
    reason: str
    degraded: bool = False  # ready, but some model is not
    shutting_down: bool = False

    @property
    def status(self) -> str:
        """One word for `/healthz`: ok, degraded, not_ready or shutting_down."""
        if self.shutting_down:
            return "shutting_down"
        if not self.ready:
            return "not_ready"
        return "degraded" if self.degraded else "ok"


@dataclass(slots=True, frozen=True)
class SchedulingFacts:
    """A model's scheduler at one moment."""

    queue_depth: int
    lane_depths: dict[str, int]
    running_rows: int
    max_batch_size: int
    batches: int
    rows: int
    expired: int
    cancelled: int
    rejected: int
    isolated_batches: int = 0  # failed batches whose requests ran again one by one


@dataclass(slots=True, frozen=True)
class ModelView:
    """Read-only facts about a model for metadata, health and index endpoints."""

    name: str
    version: str
    state: ModelState
    reason: str | None
    config: ModelConfig | None  # None for a model whose model.yaml is invalid
    load_s: float | None
    restarts: int
    recycles: int
    instances: tuple[InstanceInfo, ...]
    scheduling: SchedulingFacts | None
    serving_dtype: str | None = None  # what the workers compute in (dtype auto decides at warm-up)
    last_failure: str | None = None  # the last worker failure: exit code or signal, or why it was hung
    residency: str = "resident"  # resident, loading, evicted, not_loaded, failed, invalid (engine/model_pool.py)
    pinned: bool = False  # never evicted
    last_used_at: float | None = None  # wall clock of the model's last request
    estimated_bytes: int | None = None  # host memory all its instances are estimated to need
    measured_bytes: int | None = None  # what its workers held when last measured (Pss, after warm-up; None: never)
    budget_bytes: int | None = None  # what the memory budget counts for it now: max(estimate, measured); None: nothing
    loadable: bool = False  # lazy mode: a request would load it now
    cold_starts: int = 0  # lazy loads since the server started
    evictions: int = 0  # unloads to make room, when idle, or by an operator's evict
    last_start: dict[str, object] | None = None  # where the last worker start's time went (workers/cold_start.py)
    versions: tuple[str, ...] = ()  # every version it serves (the stable one first); () : only `version`
    rollout: dict[str, object] | None = None  # its traffic split, shadow and verdict (engine/rollout.py)

    @property
    def queue_depth(self) -> int:
        """Requests waiting in every lane."""
        return self.scheduling.queue_depth if self.scheduling else 0


class ServedModel(Protocol):
    """A ready model, resolved once per request: everything the data plane needs of it."""

    @property
    def name(self) -> str:
        """The model's name."""
        ...

    @property
    def config(self) -> ModelConfig:
        """Its configuration (inputs, outputs, preprocessing, lanes)."""
        ...

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        """The lane index for a request's urgency and/or OIP priority (`InvalidInput` if unknown)."""
        ...

    @property
    def default_timeout_s(self) -> float:
        """The model's default request timeout as in force (what a request without its own gets)."""
        ...

    def admit(self, lane: int, tenant: str = "") -> Promise | None:
        """Refuse now (`Overloaded`, `ShuttingDown`, `ModelNotReady`) what the admission chain would
        refuse at once, before the caller spends anything on reading or decoding the request.
        Returns the request's promise of a place in `lane` (engine/promised.py) where its lane
        counts them: the caller holds it until it builds the request."""
        ...


class ServingEngine(Protocol):
    """All models of a server, as the API layer uses them."""

    @property
    def ready(self) -> bool:
        """Whether the server should receive traffic (the readiness policy)."""
        ...

    def readiness(self) -> Readiness:
        """The readiness verdict with its reason, and whether some model is not ready."""
        ...

    async def readiness_async(self) -> Readiness:
        """`readiness`, allowed to ask an engine in another process (gRPC ServerReady uses it)."""
        ...

    async def resolve_async(self, name: str, version: str | None = None) -> ServedModel:
        """Model `name` for a request about to be built (`NotFound` for an unknown name or version,
        `ModelNotReady`, `ShuttingDown`); allowed to ask an engine in another process."""
        ...

    def resolve_now(self, name: str, version: str | None = None) -> ServedModel | None:
        """`resolve_async` from what this process knows now (None: it would have to ask)."""
        ...

    def submit(self, request: InferenceRequest) -> asyncio.Future[RequestResult]:
        """Admit `request` (the admission chain, engine/admission.py); a refusal is raised at once,
        the future resolves with the answer or the `ServeError` it got. Cancelling it drops the
        request if it has not run yet."""
        ...

    def submit_stream(self, request: InferenceRequest, parts: PartSink) -> asyncio.Future[RequestResult]:
        """`submit` for a stream (engine/stream.py): the same admission; a generative model's parts
        go to `parts` as they are made; the future resolves (or fails) when the stream ends."""
        ...

    def default_model_name(self) -> str:
        """The model `/predict` uses when a request names none."""
        ...

    def knows(self, name: str) -> bool:
        """Whether `name` is a model of this server (valid or not): only such names become metric labels."""
        ...
