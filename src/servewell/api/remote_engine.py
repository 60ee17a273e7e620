"""The engine as an ingress process sees it: the same `ServingEngine` boundary, over the door.

An ingress process runs the HTTP app and the data plane unchanged; its engine is this object.
`resolve` answers from the model table the engine pushes (`engine/envelope.py` ModelTable); a
model the table does not show as ready is asked about once more (`Resolve`), so a table a few
milliseconds old never refuses a model that just became ready. `infer` sends one `Envelope`
and returns a future the engine's `Outcome` resolves; cancelling the future (the client went
away) sends `Cancel`.

When the engine process is gone (killed, restarting), every request waiting on it is answered
at once with 503 `engine_unavailable`, readiness is false, and the door is dialled again every
`RECONNECT_S` until the new engine listens.

The control plane (load, unload, batching, profiles, model views, /healthz, /metrics, the
console: engine/control.py) crosses the same connection: `control(op)` sends one typed
`ControlCall`, bounded in time by the operation (`ControlOp.wait_s`), and raises 503
`engine_unavailable` when the engine is gone, is lost while the call waits, or does not answer
(api/control_plane.py puts the HTTP routes and the gRPC servicer behind it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from servewell.config.model import ModelConfig
from servewell.engine.control import ControlOp, GetReadiness
from servewell.engine.entry import not_ready
from servewell.engine.envelope import (
    Cancel,
    ControlCall,
    ControlReply,
    Envelope,
    FrameReader,
    FrameWriter,
    Hello,
    LaneState,
    LiveSettings,
    ModelEntrySummary,
    ModelTable,
    Outcome,
    Resolve,
    Resolved,
    ViewAsk,
    ViewReply,
)
from servewell.engine.full_lanes import lane_full
from servewell.engine.lanes import resolve_lane
from servewell.engine.promised import Promise, PromisedPlaces
from servewell.engine.protocol import Readiness, RequestResult
from servewell.engine.request import InferenceRequest
from servewell.engine.shared_tensors import Release, TensorLeases, TensorStore, ThreadSafeReleases, tensor_bytes
from servewell.engine.stream import PartSink, StreamOpen, StreamPartOut
from servewell.errors import EngineUnavailable, NotFound, ServeError, ShuttingDown, quote
from servewell.observability.context import (
    BatchPlacement,
    placement_var,
    request_id_var,
)

log = logging.getLogger("servewell.ingress")

#: How often a lost door is dialled again.
RECONNECT_S = 0.1
#: How often an idle tensor store is asked to give back a burst's segments.
TRIM_CHECK_S = 5.0
#: Longest a `Resolve` waits for the engine.
RESOLVE_TIMEOUT_S = 2.0

R = TypeVar("R")

_NO_ENGINE = "the engine process is not reachable (restarting); retry"


class RemoteModel:
    """A model of the engine as its table shows it, resolved for one request (`ServedModel`)."""

    __slots__ = ("_engine", "name", "config", "_lanes", "default_timeout_s")

    def __init__(self, engine: RemoteEngine, entry: ModelEntrySummary, config: ModelConfig) -> None:
        self._engine = engine
        self.name = entry.name
        self.config = config
        self._lanes = tuple(config.batching.lanes)
        timeout_ms = entry.default_timeout_ms if entry.default_timeout_ms is not None else \
            config.batching.default_timeout_ms
        self.default_timeout_s = timeout_ms / 1000.0  # as in force in the engine (an admin may change it live)

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        """Lane index for a request's urgency and/or OIP priority (engine/lanes.py)."""
        return resolve_lane(self._lanes, urgency, priority)

    def admit(self, lane: int, tenant: str = "") -> Promise:
        """Refuse now what the engine would refuse at once: the engine gone, the server shutting
        down, a full lane that `tenant` holds most of beyond its share (as the engine last said:
        engine/full_lanes.py), counting the places this process promised to requests it is still
        reading or decoding (engine/promised.py). The engine's admission chain decides the rest when
        the envelope arrives. Returns the request's promise of a place: hold it until the request is built."""
        engine = self._engine
        engine.check_open()
        refusal = engine.full_lane_refusal(self.name, self._lanes, lane, tenant)
        if refusal is None:
            return engine.promised.promise((self.name, lane))
        try:
            raise refusal
        finally:
            # This frame, in the error's traceback, must not hold the error: that cycle (error,
            # traceback, every frame up to the handler, their locals: the request, its call,
            # its connection) is freed only by the cyclic collector. Under a flood of refusals
            # an ingress process's young collections found 11,000 such objects each, and
            # paused it 10-30 ms each time (tenant_fairness, admission phase).
            refusal = None


class RemoteEngine:
    """The engine process behind the door at `path` (implements the data plane's part of
    `ServingEngine`)."""

    def __init__(self, path: str, index: int, on_live: Callable[[LiveSettings], None],
                 view_snapshot: Callable[[], Any] | None = None, *, shared_min_bytes: int = 32768,
                 shared_limit_bytes: int = 0) -> None:
        self._path = path
        self._shared_min = max(1, shared_min_bytes)
        # Request tensors of `shared_min` bytes or more go to the engine in this process's shared memory.
        self._inputs = TensorStore(shared_limit_bytes) if shared_limit_bytes > 0 else None
        self._leases: TensorLeases | None = None  # results' tensors in the engine's memory (after its Hello)
        self._releases: ThreadSafeReleases | None = None
        self._index = index
        self._source = f"ingress-{index}-{os.getpid()}"
        self._on_live = on_live
        self._view_snapshot = view_snapshot
        self._writer: FrameWriter | None = None
        self._table: ModelTable | None = None
        self._pending: dict[int, asyncio.Future[RequestResult]] = {}
        self._sinks: dict[int, PartSink] = {}  # streams: where their parts go (engine/stream.py)
        self._full_lanes: dict[tuple[str, str, int], LaneState] = {}  # whom full lanes refuse (the engine's word)
        #: places of (model, lane) promised to requests this process admitted and is still reading or decoding
        self.promised = PromisedPlaces()
        self._placements: dict[int, BatchPlacement] = {}  # the request's record, filled from its outcome
        self._asks: dict[int, asyncio.Future[Any]] = {}  # Resolve and ControlCall, failed when the door is lost
        self._ids = itertools.count(1)
        self._lost: asyncio.Event | None = None
        self.shutting_down = False  # this ingress is stopping: not ready, whatever the engine says
        self.connected_once = asyncio.Event()

    # --- the connection --------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a connection to the door until `stop` is set."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            lost = self._lost = asyncio.Event()
            try:
                await loop.create_unix_connection(lambda: FrameReader(self._on_message, self._on_lost, self._on_open),
                                                  self._path)
            except OSError:
                await _wait(stop, RECONNECT_S)
                continue
            while not stop.is_set() and not lost.is_set():
                await _either(stop, lost, TRIM_CHECK_S)
                if self._inputs is not None:
                    self._inputs.trim_if_idle()  # a burst's segments go once it is over
                if self._leases is not None:
                    self._leases.prune()  # and the engine's trimmed ones are not kept mapped here
        if self._writer is not None:
            self._writer.transport.close()
        if self._inputs is not None:
            self._inputs.close()

    def _on_open(self, transport: asyncio.Transport) -> None:
        self._writer = FrameWriter(transport)
        self._releases = ThreadSafeReleases(asyncio.get_running_loop(), self._released)
        self._writer.send(Hello(self._source, self._index, os.getpid()))
        log.info("connected to the engine", extra={"event": "engine_connected"})

    def _on_lost(self, exc: BaseException | None) -> None:
        if self._writer is None:
            return
        self._writer, self._table = None, None
        self._full_lanes.clear()  # the next engine says again
        if self._inputs is not None:
            self._inputs.abandon()  # the engine may still read them: unlink, never reuse
        if self._leases is not None:
            self._leases.close()
        self._leases, self._releases = None, None
        failure = EngineUnavailable(_NO_ENGINE)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(failure)
        self._pending.clear()
        self._placements.clear()
        for ask in self._asks.values():
            if not ask.done():
                ask.set_exception(failure)
        self._asks.clear()
        if self._lost is not None:
            self._lost.set()
        log.warning("lost the engine process%s; answering 503 engine_unavailable until it is back",
                    f" ({exc})" if exc else "", extra={"event": "engine_lost"})

    def _on_message(self, message: Any) -> None:
        if isinstance(message, StreamPartOut):
            sink = self._sinks.get(message.call_id)
            if sink is not None:
                sink.put(message.part)  # a sink that refuses cancels its stream itself (`PartBuffer`)
        elif isinstance(message, Outcome):
            future = self._pending.pop(message.call_id, None)
            placement = self._placements.pop(message.call_id, None)
            if placement is not None and message.placement is not None:
                _copy_placement(message.placement, placement)
            result = message.result
            if message.shared is not None:
                result = self._shared_outputs(message)
            if future is None or future.done():
                return
            if message.error is not None:
                future.set_exception(message.error)
            elif result is None:
                future.set_exception(EngineUnavailable("the engine's answer could not be read; retry"))
            else:
                future.set_result(result)
        elif isinstance(message, Release):
            if self._inputs is not None:
                self._inputs.release(message.blocks)
        elif isinstance(message, Hello):
            if isinstance(message.pid, int) and self._releases is not None:
                self._leases = TensorLeases(message.pid, self._releases)
        elif isinstance(message, ModelTable):
            self._table = message if self._table is None else self._table.merged(message)
            self.connected_once.set()
        elif isinstance(message, ViewAsk):
            if self._writer is not None:
                snapshot = self._view_snapshot() if self._view_snapshot is not None else None
                self._writer.send(ViewReply(message.ask_id, snapshot))
        elif isinstance(message, Resolved):
            ask = self._asks.pop(message.ask_id, None)
            if ask is not None and not ask.done():
                ask.set_result(message.entry)
        elif isinstance(message, LiveSettings):
            self._on_live(message)
        elif isinstance(message, LaneState):
            key = (message.model, message.version, message.lane)
            if message.held is None:
                self._full_lanes.pop(key, None)
            else:
                self._full_lanes[key] = message
        elif isinstance(message, ControlReply):
            ask = self._asks.pop(message.ask_id, None)
            if ask is not None and not ask.done():
                if message.error is not None:
                    ask.set_exception(message.error)
                else:
                    ask.set_result(message.result)  # pickled: read by the caller (`control`), off this dispatch

    def _shared_outputs(self, outcome: Outcome) -> RequestResult | None:
        """The outcome's result with its outputs read in place from the engine's shared memory
        (None, logged, when they cannot be: the block is released all the same)."""
        shared = outcome.shared
        assert shared is not None
        if self._leases is None:
            if self._writer is not None:
                self._writer.send(Release((shared.block,)))
            return None
        try:
            outputs = self._leases.arrays(shared)
        except ValueError as exc:
            log.error("could not read a result's tensors from the engine's shared memory: %s", exc)
            return None
        return dataclasses.replace(outcome.result, outputs=outputs) if outcome.result is not None else None

    def _released(self, blocks: tuple[int, ...]) -> None:
        if self._writer is not None:
            self._writer.send(Release(blocks))

    # --- the data plane --------------------------------------------------------------------

    def full_lane_refusal(self, model: str, lanes: tuple[str, ...], lane: int, tenant: str) -> ServeError | None:
        """The refusal the engine's scheduler would answer `tenant`'s request to `model`'s full
        `lane` with, as the engine last published it (None: send it on). A lane the engine said was
        nearly full is full here once the requests this process is still reading or decoding hold
        this process's share of its free places (engine/door.py deals the shares)."""
        table = self._table
        entry = table.models.get(model) if table is not None else None
        if entry is None or not self._full_lanes:
            return None
        state = self._full_lanes.get((model, entry.version, lane))
        if state is None or state.held is None or tenant not in state.held or entry.versions:
            return None  # a split's versions each have their own lanes: the engine draws, then decides
        promised = self.promised.count((model, lane)) if state.free else 0
        if promised < state.free:
            return None
        return lane_full(model, lanes[lane], state.depth, tenant, state.held[tenant], state.retry_after_s, promised)

    def check_open(self) -> None:
        """Raise what every request would get now: the engine gone, or shutting down."""
        table = self._table
        if self._writer is None or table is None:
            raise EngineUnavailable(_NO_ENGINE)
        if not table.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")

    def submit(self, request: InferenceRequest) -> asyncio.Future[RequestResult]:
        """Send `request` to the engine in one envelope; its outcome resolves the returned future
        (cancelling it sends `Cancel`)."""
        return self._send(request, None)

    def submit_stream(self, request: InferenceRequest, parts: PartSink) -> asyncio.Future[RequestResult]:
        """`submit` for a stream: `StreamOpen`; each `StreamPartOut` the engine sends goes to `parts`."""
        return self._send(request, parts)

    def _send(self, request: InferenceRequest, parts: PartSink | None) -> asyncio.Future[RequestResult]:
        writer = self._writer
        if writer is None:
            raise EngineUnavailable(_NO_ENGINE)
        call_id = next(self._ids)
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        placement = placement_var.get()
        if placement is not None:
            self._placements[call_id] = placement
        shared = None
        if self._inputs is not None and tensor_bytes(request.inputs) >= self._shared_min:
            shared = self._inputs.put(request.inputs)  # None: inline after all (objects, or the store is full)
            if shared is not None:
                request = request._replace(inputs={})
        if parts is None:
            writer.send(Envelope(call_id, request, shared))
        else:
            writer.send(StreamOpen(call_id, request, shared))
            self._sinks[call_id] = parts
            future.add_done_callback(lambda _: self._sinks.pop(call_id, None))
        future.add_done_callback(lambda f: self._cancelled(call_id) if f.cancelled() else None)
        return future

    def fail_all(self, error: ServeError) -> None:
        """Answer every request waiting on the engine with `error` (a shutdown cut short)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self._placements.clear()

    def _cancelled(self, call_id: int) -> None:
        self._placements.pop(call_id, None)
        if self._pending.pop(call_id, None) is not None and self._writer is not None:
            self._writer.send(Cancel(call_id))

    async def resolve_async(self, name: str, version: str | None = None) -> RemoteModel:
        """The ready model `name`: from the table, or asked of the engine when the table does
        not show it ready (`NotFound`, `ModelNotReady`, `ShuttingDown`, `EngineUnavailable`)."""
        self.check_open()
        table = self._table
        assert table is not None
        entry = table.models.get(name)
        if entry is None or (entry.state != "ready" and not entry.loadable):
            entry = await self._ask(name)
        return self._ready(name, version, entry)

    def resolve_now(self, name: str, version: str | None = None) -> RemoteModel | None:
        """`resolve_async` from the table alone: None when the table does not show the model
        serving or loadable (`resolve_async` would ask the engine)."""
        self.check_open()
        table = self._table
        entry = table.models.get(name) if table is not None else None
        if entry is None or (entry.state != "ready" and not entry.loadable):
            return None
        return self._ready(name, version, entry)

    def _ready(self, name: str, version: str | None, entry: ModelEntrySummary | None) -> RemoteModel:
        if entry is None:
            known = sorted(self._table.models)[:20] if self._table is not None else []
            raise NotFound(f"unknown model {quote(name)}; this server has {known}")
        if version not in (None, "", entry.version) and version not in entry.versions:
            raise NotFound(f"model '{name}' has no version {quote(version)}; it serves "
                           f"{[entry.version, *entry.versions]}")
        if (entry.state != "ready" and not entry.loadable) or entry.config is None:
            # A loadable model (lazy mode) goes to the engine, which loads it while the request waits.
            raise not_ready(name, entry.state, entry.reason)  # the engine's own words and Retry-After
        return RemoteModel(self, entry, entry.config)

    async def _ask(self, name: str) -> ModelEntrySummary | None:
        writer = self._writer
        if writer is None:
            raise EngineUnavailable(_NO_ENGINE)
        ask_id = next(self._ids)
        future: asyncio.Future[ModelEntrySummary | None] = asyncio.get_running_loop().create_future()
        self._asks[ask_id] = future
        writer.send(Resolve(ask_id, name))
        try:
            return await asyncio.wait_for(future, RESOLVE_TIMEOUT_S)
        except TimeoutError:
            raise EngineUnavailable("the engine did not answer in time; retry") from None
        finally:
            self._asks.pop(ask_id, None)

    def default_model_name(self) -> str:
        """The model `/predict` uses when a request names none."""
        table = self._table
        if table is None:
            raise EngineUnavailable(_NO_ENGINE)
        if table.default_model is None:
            raise NotFound("the repository has no valid model")
        return table.default_model

    def knows(self, name: str) -> bool:
        """Whether `name` is a model of this server (only such names become metric labels)."""
        table = self._table
        return table is not None and name in table.models

    # --- health, as far as an ingress answers it itself --------------------------------------

    @property
    def ready(self) -> bool:
        """Whether this ingress should receive traffic."""
        return self.readiness().ready

    def readiness(self) -> Readiness:
        """The engine's verdict, unless this ingress is stopping or has lost the engine."""
        if self.shutting_down:
            return Readiness(False, "this ingress process is shutting down", shutting_down=True)
        if self._writer is None or self._table is None:
            return Readiness(False, _NO_ENGINE)
        return self._table.readiness

    async def readiness_async(self) -> Readiness:
        """`readiness`; when the pushed table says not ready, the engine's own verdict (the table
        lags it by up to one push, 50 ms: a probe right after the engine turned ready must see it)."""
        local = self.readiness()
        if local.ready or local.shutting_down or self._writer is None or self._table is None:
            return local
        try:
            fresh = await self.control(GetReadiness())
        except EngineUnavailable:
            return local
        return fresh if not self.shutting_down else self.readiness()

    # --- the control plane (engine/control.py) -------------------------------------------------

    async def control(self, op: ControlOp[R]) -> R:
        """`op` answered by the engine's control plane: its result, or the `ServeError` its handler
        raised; `EngineUnavailable` when the engine is gone, is lost while the call waits, or does
        not answer within `op.wait_s()` seconds."""
        writer = self._writer
        if writer is None:
            raise EngineUnavailable(_NO_ENGINE)
        ask_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asks[ask_id] = future
        writer.send(ControlCall(ask_id, op, request_id_var.get()))
        wait_s = op.wait_s()
        try:
            pickled = await asyncio.wait_for(future, wait_s)
        except TimeoutError:
            raise EngineUnavailable(f"the engine did not answer in {wait_s:g} s; retry") from None
        finally:
            self._asks.pop(ask_id, None)
        result: R = pickle.loads(pickled)
        return result


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _either(a: asyncio.Event, b: asyncio.Event, timeout_s: float | None = None) -> None:
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _copy_placement(source: BatchPlacement, target: BatchPlacement) -> None:
    """The engine's facts about where a request ran, into the ingress's record of it."""
    for field in dataclasses.fields(source):
        setattr(target, field.name, getattr(source, field.name))
