"""Typed messages between the frontend and a worker process.

Small control messages travel pickled over a pipe; tensor bytes never do: they live in
shared memory and the messages carry only `TensorRef` descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servewell.config.model import ModelConfig
from servewell.observability.tracing import TracingSettings


@dataclass(slots=True, frozen=True)
class TensorRef:
    """Where one tensor lies in a shared-memory segment."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# frontend -> worker


@dataclass(slots=True, frozen=True)
class WorkerLaunch:
    """What a worker process is started with, besides its model's config."""

    model_dir: str  # the server's private snapshot of the model directory
    instance: int = 0
    segment_prefix: str = ""  # every shared-memory segment the worker makes starts with this
    heartbeat: str = ""  # the frontend-owned segment whose counter the worker's heartbeat thread increments
    heartbeat_interval_s: float = 0.1
    log_level: str = "info"
    log_format: str = "json"
    tracing: TracingSettings | None = None
    #: The device this instance runs on, chosen by the engine's pool (`workers/devices.py`); the
    #: worker applies it ("" keeps the model config's `device`).
    device: str = ""
    #: Warm up batch sizes 1 and 2 only where no memory limit needs the larger ones proven
    #: (`runtimes/warmup.py` `first_only`; the server's `warmup_batch_sizes: first`).
    warmup_first_only: bool = False


@dataclass(slots=True, frozen=True)
class SpareLaunch:
    """What a spare worker (`workers/spare.py`) is started with: no model yet."""

    log_level: str = "info"
    log_format: str = "json"


@dataclass(slots=True, frozen=True)
class AdoptSpare:
    """A spare worker becomes the worker of this model: it loads it as a freshly spawned one would."""

    config: ModelConfig
    launch: WorkerLaunch
    process_name: str  # what a fresh worker's process would have been named


@dataclass(slots=True, frozen=True)
class RunBatch:
    """Run one batch whose inputs lie in the shared-memory segment `segment`."""

    batch_id: int
    segment: str
    inputs: tuple[TensorRef, ...]
    traceparent: str | None = None  # the batch span; the worker's compute span is its child
    #: Rows of each request, in batch order (empty: one request, the whole batch).
    request_rows: tuple[int, ...] = ()
    #: Each request's absolute deadline, `time.monotonic()` seconds (the server's one deadline unit);
    #: the worker skips the requests whose deadline passed before compute (`workers/expiry.py`).
    deadlines: tuple[float, ...] = ()


@dataclass(slots=True, frozen=True)
class Shutdown:
    """Finish the batch in hand, release resources and exit."""


@dataclass(slots=True, frozen=True)
class StartProfile:
    """Profile every batch from now on, writing the trace under `directory`."""

    directory: str


@dataclass(slots=True, frozen=True)
class StopProfile:
    """Stop profiling and report the trace file."""


# worker -> frontend


@dataclass(slots=True, frozen=True)
class SpareReady:
    """A spare worker is up with its runtime imported and waits for `AdoptSpare`."""

    pid: int
    import_s: float  # interpreter up to runtime imported


@dataclass(slots=True, frozen=True)
class LoadProgress:
    """The worker reached a loading stage."""

    stage: str
    elapsed_s: float


@dataclass(slots=True, frozen=True)
class WorkerReady:
    """The model loaded and warmed up; the worker accepts batches."""

    pid: int
    load_s: float
    warmup_s: float
    rss_bytes: int
    stages: tuple[tuple[str, float], ...] = field(default_factory=tuple)
    effective_max_batch_size: int = 0  # what warm-up proved fits the memory limit (0: no batching)
    peak_bytes_by_batch: tuple[tuple[int, int], ...] = ()  # (batch size, peak resident bytes) from warm-up
    serving_dtype: str = ""
    latency_by_batch: tuple[tuple[int, float], ...] = ()  # (batch size, seconds) of each warm-up batch
    #: When this worker began on this model, `time.monotonic()` (system-wide on Linux): a fresh
    #: worker's entry point (its interpreter up), or the moment a spare was adopted (0: unknown).
    began_at: float = 0.0
    import_s: float = 0.0  # from `began_at` until the runtime's modules were imported
    weights_s: float = 0.0  # from then until the model was loaded, before warm-up


@dataclass(slots=True, frozen=True)
class WorkerLoadFailed:
    """The model could not be loaded; the worker exits after sending this."""

    reason: str


@dataclass(slots=True, frozen=True)
class BatchDone:
    """Outputs of a batch, in the worker's output segment `segment`."""

    batch_id: int
    segment: str
    outputs: tuple[TensorRef, ...]
    compute_s: float
    rss_bytes: int
    rows_computed: int = 0  # rows this worker has run since it started, this batch included
    steps: tuple[tuple[str, float], ...] = ()  # trace_step() durations measured during the batch
    oom_limited_batch_size: int | None = None  # largest batch that fit device memory after an OOM split
    #: Requests (indices into the batch's requests) not run because their deadline had passed; the
    #: outputs hold the rows of the others only, in order. All of them: nothing was computed.
    skipped: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class BatchFailed:
    """The model raised while running a batch; the worker stays up."""

    batch_id: int
    message: str
    fatal: bool = False  # the worker exits after this (device unusable) and is restarted


@dataclass(slots=True, frozen=True)
class ProfileDone:
    """A Chrome/Perfetto trace file of the profiled batches, or why there is none."""

    path: str | None
    error: str | None = None


WorkerReply = SpareReady | ProfileDone | LoadProgress | WorkerReady | WorkerLoadFailed | BatchDone | BatchFailed
