"""Typed messages between the frontend and a worker process.

Small control messages travel pickled over a pipe; tensor bytes never do: they live in
shared memory and the messages carry only `TensorRef` descriptors.

The two messages of every batch, `RunBatch` and `BatchDone`, travel as a marshalled tuple of
their fields instead (`send_message`, `receive_message`): pickling a dataclass and building it back
costs about 6-12 us each way warm, twice per batch on each side of the pipe, where marshal takes
under 1 us. Every message is one frame whose first byte says which: `M` (RunBatch), `D`
(BatchDone) or `P` (anything else, pickled). Both ends are this server's own processes.
"""

from __future__ import annotations

import marshal
import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from servewell.config.model import ModelConfig
from servewell.errors import ServeError
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
    #: "idle": load and warm up on a SCHED_IDLE thread where that applies (`process_main.load_policy`);
    #: the server's `load_cpu_policy`.
    load_cpu_policy: str = "normal"
    #: The largest answer to one request, in bytes, for a model whose config sets no
    #: `max_output_bytes` (the server's; 0: no bound).
    max_output_bytes: int = 0


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
class SequenceJoin:
    """A sequence that joins a generative model's running batch at the worker's next step, with its
    inputs (small: a prompt; pickled over the pipe, bounded by the model's `generate.max_state_bytes`)."""

    seq_id: int
    inputs: dict[str, Any]  # name -> numpy array, the request's own rows
    limit: int = 0  # its most parts: the worker ends it with the last (0: no bound)


@dataclass(slots=True, frozen=True)
class SequenceChanges:
    """What a generative model's worker applies before its next step (runtimes/python_sequences.py):
    the `leaves` end (cancelled, expired, too slow), the `joins` start. The worker steps on its own
    while it has sequences, one `StepDone` (or `StepFailed`) per step, and reads what came meanwhile
    before each step: a change never waits for a round trip, nor a part for the engine's answer."""

    joins: tuple[SequenceJoin, ...] = ()
    leaves: tuple[int, ...] = ()


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
    loaded_at: str = "normal"  # the CPU policy the load and warm-up ran at: "idle" or "normal"


@dataclass(slots=True, frozen=True)
class WorkerLoadFailed:
    """The model could not be loaded; the worker exits after sending this."""

    reason: str
    #: The load at idle priority waited for a core too long (`process_main.run_at_idle`): not the
    #: model's fault, the engine loads it again at normal priority.
    starved: bool = False


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
    #: The error to answer the batch's requests with, where it is not the model's raising
    #: (`model_error`): an answer over `max_output_bytes`, no shared memory for the outputs.
    refusal: ServeError | None = None


@dataclass(slots=True, frozen=True)
class SequencePart:
    """What one sequence made at a step: its part's outputs (None: nothing this step), whether it is
    done, or the model's error for this sequence alone (it has ended)."""

    seq_id: int
    outputs: dict[str, Any] | None
    done: bool = False
    error: str | None = None


@dataclass(slots=True, frozen=True)
class StepDone:
    """The parts of one step, one per running sequence (or the sequences a change ended: a failed
    start), and the step's compute time; `step_id` counts the worker's steps."""

    step_id: int
    parts: tuple[SequencePart, ...]
    compute_s: float
    rss_bytes: int = 0


@dataclass(slots=True, frozen=True)
class StepFailed:
    """The step failed as a whole (the model raised outside any one sequence): every sequence it
    ran has ended; the worker stays up unless `fatal`."""

    step_id: int
    message: str
    fatal: bool = False


@dataclass(slots=True, frozen=True)
class ProfileDone:
    """A Chrome/Perfetto trace file of the profiled batches, or why there is none."""

    path: str | None
    error: str | None = None


WorkerReply = (SpareReady | ProfileDone | LoadProgress | WorkerReady | WorkerLoadFailed | BatchDone | BatchFailed
               | StepDone | StepFailed)


WorkerMessage = RunBatch | SequenceChanges | Shutdown | StartProfile | StopProfile | AdoptSpare | WorkerReply
_RUN, _DONE, _STEP, _PICKLED = b"M", b"D", b"S", b"P"


def encode_message(message: WorkerMessage) -> bytes:
    """One frame: the batch messages marshalled field by field, anything else pickled.

    Every number is made a plain int or float first: marshal writes any object with a buffer (a
    numpy scalar) as bytes, silently. A field marshal refuses (a str subclass) sends it pickled."""
    try:
        if type(message) is RunBatch:
            return _RUN + marshal.dumps((
                int(message.batch_id), message.segment, _ref_tuples(message.inputs), message.traceparent,
                tuple(map(int, message.request_rows)), tuple(map(float, message.deadlines))))
        if type(message) is BatchDone:
            oom = message.oom_limited_batch_size
            return _DONE + marshal.dumps((
                int(message.batch_id), message.segment, _ref_tuples(message.outputs), float(message.compute_s),
                int(message.rss_bytes), int(message.rows_computed),
                tuple((name, float(seconds)) for name, seconds in message.steps), None if oom is None else int(oom),
                tuple(map(int, message.skipped))))
        if type(message) is StepDone:  # one a step while sequences run: pickling its parts cost ~10 us each
            return _STEP + marshal.dumps((
                int(message.step_id), float(message.compute_s), int(message.rss_bytes),
                tuple((int(p.seq_id), None if p.outputs is None else _array_tuples(p.outputs), bool(p.done), p.error)
                      for p in message.parts)))
    except ValueError:
        pass
    return _PICKLED + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_message(frame: bytes) -> WorkerMessage:
    """The message of one `encode_message` frame (`ValueError` for a frame it did not make)."""
    kind, body = frame[:1], frame[1:]
    if kind == _RUN:
        batch_id, segment, refs, traceparent, request_rows, deadlines = marshal.loads(body)
        return RunBatch(batch_id, segment, _refs(refs), traceparent, request_rows, deadlines)
    if kind == _DONE:
        batch_id, segment, refs, compute_s, rss, rows, steps, oom_limited, skipped = marshal.loads(body)
        return BatchDone(batch_id, segment, _refs(refs), compute_s, rss, rows, steps, oom_limited, skipped)
    if kind == _STEP:
        step_id, compute_s, rss, parts = marshal.loads(body)
        return StepDone(step_id, tuple(SequencePart(seq_id, None if outputs is None else _arrays(outputs), done, error)
                                       for seq_id, outputs, done, error in parts), compute_s, rss)
    if kind == _PICKLED:
        message: WorkerMessage = pickle.loads(body)
        return message
    raise ValueError(f"not a worker message frame (first byte {kind!r})")


def send_message(conn: Connection, message: WorkerMessage) -> None:
    """Write one message to the pipe (`OSError`, `ValueError` once it is closed)."""
    conn.send_bytes(encode_message(message))


def receive_message(conn: Connection) -> WorkerMessage:
    """Read one message from the pipe, waiting for it (`EOFError` once the other end closed)."""
    return decode_message(conn.recv_bytes())


def _ref_tuples(refs: tuple[TensorRef, ...]) -> tuple[tuple[Any, ...], ...]:
    return tuple((r.name, r.dtype, tuple(map(int, r.shape)), int(r.offset), int(r.nbytes)) for r in refs)


def _refs(rows: tuple[tuple[Any, ...], ...]) -> tuple[TensorRef, ...]:
    return tuple(TensorRef(*row) for row in rows)


def _array_tuples(outputs: dict[str, Any]) -> tuple[tuple[str, bytes, str, tuple[int, ...]], ...]:
    """A part's outputs as (name, bytes, dtype, shape): `ValueError` for anything but an array of
    numbers or bytes (the message is then pickled whole)."""
    rows = []
    for name, array in outputs.items():
        if type(array) is not np.ndarray or array.dtype.hasobject or type(name) is not str:
            raise ValueError("not a plain array")
        rows.append((name, array.tobytes(), array.dtype.str, tuple(map(int, array.shape))))
    return tuple(rows)


def _arrays(rows: tuple[tuple[str, bytes, str, tuple[int, ...]], ...]) -> dict[str, Any]:
    return {name: np.frombuffer(data, dtype).reshape(shape) for name, data, dtype, shape in rows}
