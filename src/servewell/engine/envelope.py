"""The message boundary between an ingress process and the engine process.

An inference request crosses it as one `Envelope`: id, model, version, lane, tenant (API key id),
an absolute deadline, the trace context and the input tensors; the engine answers with one
`Outcome` (the request's own output rows and timings, or the `ServeError` that refused it).
Around them: the engine pushes its model table (`ModelTable`) and live settings
(`LiveSettings`), pulls each ingress's share of the metrics and console records (`ViewAsk` /
`ViewReply`), an ingress asks about a model it does not know yet (`Resolve`), and every admin,
repository, metadata and view operation an ingress serves crosses as one typed `ControlCall`
(engine/control.py) answered by a `ControlReply`.

Deadlines and arrival times are absolute `time.monotonic()` seconds (the event loop's clock):
CLOCK_MONOTONIC is one clock for every process of the machine, so the number means the same
thing from the HTTP parser to the worker.

Frames on the unix socket: a 4-byte big-endian length, then a pickled list of messages. Every
message written while the event loop runs one step goes out in one frame (`FrameWriter`), so
under load many envelopes or outcomes share one write and one read. Pickle is safe here for
the same reason it is on the worker pipes: both ends are servewell processes of one server,
and the socket lives in the supervisor's private (0700) run directory.

Tensors of `shared_tensor_min_bytes` or more do not travel in the frame: the envelope (inputs)
or the outcome (outputs) carries a `SharedTensors` reference to a block of its sender's shared
memory, and the receiver answers `Release` when it no longer uses it (`engine/shared_tensors.py`).
Both sides say `Hello` first, with the pid their segments are named after.
"""

from __future__ import annotations

import asyncio
import io
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.control import ControlOp
from servewell.engine.protocol import Readiness, RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.shared_tensors import SharedTensors
from servewell.errors import ServeError
from servewell.observability.context import BatchPlacement
from servewell.tenancy.keys import KeyRing

#: Largest frame either side accepts (a batch of envelopes with their tensors): a larger length
#: prefix means a broken peer, and the connection is closed.
MAX_FRAME_BYTES = 1 << 30
_HEADER = struct.Struct(">I")
_NO_LENGTH = bytes(_HEADER.size)  # the length prefix's place, filled in once the body is written


@dataclass(slots=True)
class Envelope:
    """One inference request on its way to the engine: the request whole (engine/request.py), as
    the ingress built it; its tensors of `shared_tensor_min_bytes` or more in the ingress's shared
    memory (`shared`, then the request's `inputs` is empty)."""

    call_id: int  # unique per ingress connection; the outcome and a cancel name it
    request: InferenceRequest
    shared: SharedTensors | None = None

    def __reduce__(self) -> tuple[type[Envelope], tuple[object, ...]]:
        return (Envelope, (self.call_id, self.request, self.shared))


@dataclass(slots=True)
class Outcome:
    """The engine's answer to one envelope: a result or the error that refused it."""

    call_id: int
    result: RequestResult | None = None
    error: ServeError | None = None
    placement: BatchPlacement | None = None  # the batch it ran in, for the ingress's logs and console
    shared: SharedTensors | None = None  # the result's outputs in the engine's shared memory (`outputs` empty)

    def __reduce__(self) -> tuple[type[Outcome], tuple[object, ...]]:
        return (Outcome, (self.call_id, self.result, self.error, self.placement, self.shared))


@dataclass(slots=True, frozen=True)
class Cancel:
    """The client went away: drop the request if it has not run yet."""

    call_id: int


@dataclass(slots=True, frozen=True)
class ModelEntrySummary:
    """What an ingress needs of one model to decode, validate and route its requests."""

    name: str
    version: str
    state: str
    reason: str | None
    config: ModelConfig | None
    lanes: tuple[str, ...] = ()
    loadable: bool = False  # lazy mode: not resident, and a request loads it (the engine waits for the load)
    versions: tuple[str, ...] = ()  # the other versions it serves beside `version` (a traffic split)
    #: Its default request timeout as in force (an admin may change it live; None: model.yaml's):
    #: the ingress resolves every request's absolute deadline with it.
    default_timeout_ms: float | None = None


@dataclass(slots=True, frozen=True)
class ModelTable:
    """Every model of the engine as the ingress processes see them: in full when an ingress
    connects, then only what changed (`complete` false: `models` holds the changed entries and
    `removed` the names gone). With hundreds of models (lazy mode) a load or an eviction must not
    cost every loop a megabyte of pickled configs."""

    models: dict[str, ModelEntrySummary]
    default_model: str | None
    readiness: Readiness
    accepting: bool
    complete: bool = True
    removed: tuple[str, ...] = ()

    def merged(self, change: ModelTable) -> ModelTable:
        """This table with `change` applied (`change` itself when it is complete)."""
        if change.complete:
            return change
        models = {name: entry for name, entry in self.models.items() if name not in change.removed}
        models.update(change.models)
        return ModelTable(models, change.default_model, change.readiness, change.accepting)


@dataclass(slots=True, frozen=True)
class LiveSettings:
    """Settings that change while serving and that the ingress processes apply too."""

    settings: Any  # ServerConfig as the engine's config reloader applied it
    keys: KeyRing  # the API keys in force (tenancy/keys.py: the engine reads them without importing api/)
    default_rate_per_s: float | None = None


@dataclass(slots=True, frozen=True)
class LaneState:
    """Whom one model version's full (or nearly full) lane refuses (engine/full_lanes.py): tenant
    -> places it holds, this ingress's share of the places still free (0: none left to it), and
    the Retry-After; `held` None once the lane is far from full. Sent when it changes, and every
    such lane when an ingress connects."""

    model: str
    version: str
    lane: int
    held: dict[str, int] | None
    depth: int = 0  # requests queued in the lane
    retry_after_s: float = 1.0
    free: int = 0  # places left before the lane is full that this ingress may promise (engine/promised.py)


@dataclass(slots=True, frozen=True)
class Resolve:
    """An ingress asks about a model missing from its table (or not ready there)."""

    ask_id: int
    model: str


@dataclass(slots=True, frozen=True)
class Resolved:
    """The engine's answer to `Resolve`: the model's summary, or None when it has no such model."""

    ask_id: int
    entry: ModelEntrySummary | None


@dataclass(slots=True, frozen=True)
class ViewAsk:
    """The engine asks an ingress for its metrics and console records (cumulative)."""

    ask_id: int


@dataclass(slots=True)
class ViewReply:
    """An ingress's answer to `ViewAsk`."""

    ask_id: int
    snapshot: Any


@dataclass(slots=True, frozen=True)
class Hello:
    """The first message each side of a door connection sends: who it is (the engine's `source` is
    "engine", index -1)."""

    source: str  # e.g. "ingress-0-1234": names its share of the metrics
    index: int
    pid: int  # its shared-memory segments are named after it (`engine/shared_tensors.py`)


@dataclass(slots=True, frozen=True)
class ControlCall:
    """An ingress asks the engine's control plane: one typed operation (engine/control.py), whichever
    protocol asked for it; the engine answers `ControlReply`."""

    ask_id: int
    op: ControlOp[Any]
    request_id: str = ""  # the asking request's id: the engine's log lines about it carry it


@dataclass(slots=True)
class ControlReply:
    """The engine's answer to `ControlCall`: the operation's result, or the `ServeError` it raised."""

    ask_id: int
    result: bytes | None = None  # the result, pickled by the engine (`pickle.loads` reads it)
    error: ServeError | None = None


def encode_frame(messages: list[Any]) -> bytes:
    """One frame holding `messages`."""
    buffer = io.BytesIO()
    buffer.write(_NO_LENGTH)
    _FramePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(messages)
    frame = buffer.getbuffer()
    _HEADER.pack_into(frame, 0, len(frame) - _HEADER.size)
    del frame
    return buffer.getvalue()


class _FramePickler(pickle.Pickler):
    """Pickles a frame's messages, a numpy array of numbers as its bytes, dtype and shape: numpy's
    own reduce costs about 9 us per small array to write and 5 us to read, this 1 us and 1 us (a
    request's inputs and its answer's outputs cross the door in every envelope and outcome)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            array = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            return _array, (pickle.PickleBuffer(array.data), array.dtype.str, array.shape)
        return NotImplemented


def _array(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array read back from a frame (a view of the frame's bytes: read-only)."""
    return np.frombuffer(data, dtype).reshape(shape)


class FrameReader(asyncio.Protocol):
    """Reads frames from a unix socket and hands each message to `on_message`; a malformed
    frame closes the connection (a broken peer), never the process."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[BaseException | None], None],
                 on_open: Callable[[asyncio.Transport], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_open = on_open
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._need = _HEADER.size  # bytes that make the next frame (header first)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self._on_open(self.transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered < self._need:
            return
        buffer = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        start = 0
        messages: list[Any] = []
        try:
            while len(buffer) - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buffer, start)
                if length > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES} byte bound")
                end = start + _HEADER.size + length
                if end > len(buffer):
                    break
                messages.extend(pickle.loads(memoryview(buffer)[start + _HEADER.size:end]))
                start = end
        except Exception as exc:
            if self.transport is not None:
                self.transport.abort()
            self._chunks, self._buffered = [], 0
            self._on_lost(exc)
            return
        rest = buffer[start:] if start else buffer
        self._chunks = [rest] if rest else []
        self._buffered = len(rest)
        self._need = (_HEADER.size + _HEADER.unpack_from(rest, 0)[0]) if len(rest) >= _HEADER.size else _HEADER.size
        for message in messages:
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


@dataclass(slots=True)
class FrameWriter:
    """Collects the messages written during one event-loop step and sends them as one frame."""

    transport: asyncio.Transport
    _pending: list[Any] = field(default_factory=list)
    _scheduled: bool = False

    def send(self, message: Any) -> None:
        """Queue `message`; it leaves with the others of this loop step."""
        self._pending.append(message)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        messages, self._pending = self._pending, []
        if messages and not self.transport.is_closing():
            self.transport.write(encode_frame(messages))
