"""The engine's door: where ingress processes hand in envelopes and get outcomes.

One unix-socket connection per ingress process (`engine/envelope.py` has the messages and the
framing). An envelope is resolved, validated and queued exactly as an in-process request is
(`InferenceEngine.submit(request)`, the admission chain), inside the request's trace context and id,
so the batch span, the logs and the metrics are the same; its outcome goes back when the future
resolves. A `Cancel` drops a request that has not run; a connection that closes (its ingress
died or stopped) cancels everything it still had queued.

The door also keeps every ingress's model table and live settings current (pushed at connect
and on every change; a change is noticed within `TABLE_POLL_S`, and an ingress that meets a
model its table lacks asks with `Resolve`), and pulls the ingress processes' share of the
metrics and console records when a view is read (`pull_views`).

Every admin, repository, metadata and view operation an ingress serves (HTTP or gRPC) arrives as
one `ControlCall` carrying a typed operation (engine/control.py); the door runs it through the
engine's one dispatch table (`ControlDispatch`: a type it does not hold is refused) and answers
`ControlReply` with the result or the `ServeError` the handler raised.
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
from functools import partial
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.propagate import extract

from servewell.engine.control import ControlDispatch, ControlOp
from servewell.engine.engine import InferenceEngine
from servewell.engine.entry import Entry
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
from servewell.engine.full_lanes import BoardChange
from servewell.engine.protocol import RequestResult
from servewell.engine.shared_tensors import (
    Release,
    SharedTensors,
    TensorLeases,
    TensorStore,
    ThreadSafeReleases,
    tensor_bytes,
)
from servewell.engine.stream import StreamOpen, StreamPart, StreamPartOut
from servewell.errors import ModelError, ServeError, quote
from servewell.observability.context import BatchPlacement, placement_var, request_id_var
from servewell.workers.shm import COPIES, OFF_LOOP_BYTES

log = logging.getLogger("servewell.engine")

#: How often the door compares the model table with what it last pushed (cheap: a tuple per model).
TABLE_POLL_S = 0.05
#: Longest a view read waits for the ingress processes' snapshots before using what it has.
VIEW_PULL_TIMEOUT_S = 1.0
#: Every this many table polls (about 5 s) the door forgets its mappings of segments an ingress unlinked.
_PRUNE_EVERY_TICKS = 100


def summarize(entry: Entry, loadable: bool = False, versions: tuple[str, ...] = ()) -> ModelEntrySummary:
    """What an ingress needs of one model (`loadable`: lazy mode, a request loads it; `versions`:
    the other versions it serves)."""
    return ModelEntrySummary(entry.name, entry.version, entry.state, entry.reason, entry.config, loadable=loadable,
                             versions=versions, default_timeout_ms=live_timeout_ms(entry))


def live_timeout_ms(entry: Entry) -> float | None:
    """`entry`'s default request timeout as in force (its scheduler's, which an admin may change
    live); None for an entry without a scheduler (model.yaml's then)."""
    scheduler = getattr(entry, "scheduler", None)
    return scheduler.limits.batching.default_timeout_ms if scheduler is not None else None


def model_table(engine: InferenceEngine) -> ModelTable:
    """The engine's models as the ingress processes see them."""
    views, registry = engine.views, engine.registry
    models = {entry.name: summarize(entry, views.loadable(entry.name), registry.other_versions(entry.name))
              for entry in registry.entries()}
    try:
        default: str | None = engine.default_model_name()
    except ServeError:
        default = None
    return ModelTable(models, default, engine.readiness(), engine.accepting)


def _fingerprint(entry: ModelEntrySummary) -> tuple[Any, ...]:
    return (entry.version, entry.state, entry.reason, id(entry.config), entry.loadable, entry.versions,
            entry.default_timeout_ms)


class _Ingress:
    """One connected ingress process."""

    __slots__ = ("writer", "pending", "source", "closed", "leases", "releases", "outputs")

    def __init__(self, writer: FrameWriter, limit_bytes: int) -> None:
        self.writer = writer
        self.pending: dict[int, asyncio.Future[RequestResult]] = {}
        self.source = ""
        self.closed = False
        self.leases: TensorLeases | None = None  # its request tensors in its shared memory (after Hello)
        self.releases = ThreadSafeReleases(asyncio.get_running_loop(), self._released)
        self.outputs = TensorStore(limit_bytes) if limit_bytes > 0 else None  # results' tensors it reads in place

    def _released(self, blocks: tuple[int, ...]) -> None:
        if not self.closed:
            self.writer.send(Release(blocks))

    def close(self) -> None:
        self.closed = True
        if self.leases is not None:
            self.leases.close()
        if self.outputs is not None:
            self.outputs.abandon()  # it may still read them: never reuse, unlink


class DoorPartSink:
    """A stream's parts, sent to the ingress that opened it (before its `Outcome`, on the same connection)."""

    __slots__ = ("_ingress", "_call_id")

    def __init__(self, ingress: _Ingress, call_id: int) -> None:
        self._ingress, self._call_id = ingress, call_id

    def put(self, part: StreamPart) -> bool:
        """Send `part`; False once the ingress is gone (its stream then ends)."""
        if self._ingress.closed:
            return False
        self._ingress.writer.send(StreamPartOut(self._call_id, part))
        return True


class EngineDoor:
    """The unix-socket server ingress processes connect to."""

    def __init__(self, engine: InferenceEngine, path: str, live: Callable[[], LiveSettings],
                 absorb: Callable[[str, Any], object] | None = None,
                 retire: Callable[[str], None] | None = None, *, shared_min_bytes: int = 32768,
                 shared_limit_bytes: int = 0, control: ControlDispatch | None = None) -> None:
        self._engine = engine
        self._control = control  # the engine's control-plane table (None: every ControlCall is refused)
        self._shared_min = shared_min_bytes
        self._shared_limit = shared_limit_bytes
        self._path = path
        self._live = live
        self._absorb = absorb
        self._retire = retire
        self._ingresses: set[_Ingress] = set()
        self._server: asyncio.AbstractServer | None = None
        self._table_task: asyncio.Task[None] | None = None
        self._last_prints: dict[str, tuple[Any, ...]] = {}  # per model, as last pushed
        self._last_head: tuple[Any, ...] | None = None  # default model, readiness, accepting as last pushed
        self._last_live: tuple[Any, ...] | None = None
        self._last_key: tuple[Any, ...] | None = None  # the engine's `table_key` at the last comparison
        self._asks: dict[int, asyncio.Future[Any]] = {}
        self._ask_ids = itertools.count(1)
        self._control_tasks: set[asyncio.Future[Any]] = set()  # control calls being awaited (strong refs)
        self._copies: set[asyncio.Future[SharedTensors | None]] = set()  # large results being written (strong refs)

    async def start(self) -> None:
        """Listen (the socket file is the owner's only)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        self._server = await loop.create_unix_server(self._protocol, self._path)
        os.chmod(self._path, 0o600)
        self._table_task = loop.create_task(self._watch_table())
        self._engine.full_lanes.listeners.append(self._lane_changed)

    def _lane_changed(self, change: BoardChange) -> None:
        """A (nearly) full lane now refuses other tenants, has other places free, or is far from
        full again: every ingress hears it (in its next frame)."""
        ingresses = len(self._ingresses)
        for rank, ingress in enumerate(self._ingresses):
            ingress.writer.send(_lane_state(change, rank, ingresses))

    async def stop(self) -> None:
        """Close the listener and every connection (their queued requests are cancelled)."""
        if self._table_task is not None:
            self._table_task.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self._control_tasks):
            task.cancel()
        for ingress in list(self._ingresses):
            ingress.writer.transport.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    async def pull_views(self, timeout_s: float = VIEW_PULL_TIMEOUT_S) -> None:
        """Ask every ingress for its metrics and console records and absorb what comes back in
        time (an ingress that does not answer keeps its previous snapshot)."""
        if self._absorb is None or not self._ingresses:
            return
        asks = []
        for ingress in list(self._ingresses):
            ask_id = next(self._ask_ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._asks[ask_id] = future
            asks.append((ask_id, ingress, future))
            ingress.writer.send(ViewAsk(ask_id))
        try:
            await asyncio.wait([f for _, _, f in asks], timeout=timeout_s)
        finally:
            for ask_id, ingress, future in asks:
                self._asks.pop(ask_id, None)
                if future.done() and not future.cancelled() and future.exception() is None and ingress.source:
                    self._absorb(ingress.source, future.result())
                future.cancel()

    # --- one connection ----------------------------------------------------------------------

    def _protocol(self) -> FrameReader:
        box: list[_Ingress] = []

        def opened(transport: asyncio.Transport) -> None:
            ingress = _Ingress(FrameWriter(transport), self._shared_limit)
            box.append(ingress)
            self._ingresses.add(ingress)
            ingress.writer.send(Hello("engine", -1, os.getpid()))
            ingress.writer.send(model_table(self._engine))
            ingress.writer.send(self._live())
            for (model, version, lane), refusals in self._engine.full_lanes.lanes.items():
                # dealt as the last of the ingress processes (the others' shares were dealt before it came)
                ingress.writer.send(_lane_state((model, version, lane, refusals), len(self._ingresses) - 1,
                                                len(self._ingresses)))

        def received(message: Any) -> None:
            self._on_message(box[0], message)

        def lost(exc: BaseException | None) -> None:
            if box:
                self._on_lost(box[0], exc)

        return FrameReader(received, lost, opened)

    def _on_message(self, ingress: _Ingress, message: Any) -> None:
        if isinstance(message, Envelope):
            self._on_envelope(ingress, message)
        elif isinstance(message, StreamOpen):  # a stream: its parts go back as StreamPartOut (engine/stream.py)
            self._on_envelope(ingress, Envelope(message.call_id, message.request, message.shared), stream=True)
        elif isinstance(message, Release):
            if ingress.outputs is not None:
                ingress.outputs.release(message.blocks)
        elif isinstance(message, Cancel):
            future = ingress.pending.get(message.call_id)
            if future is not None:
                future.cancel()
        elif isinstance(message, ViewReply):
            ask = self._asks.get(message.ask_id)
            if ask is not None and not ask.done():
                ask.set_result(message.snapshot)
        elif isinstance(message, Resolve):
            views, registry = self._engine.views, self._engine.registry
            entry = next((summarize(e, views.loadable(e.name), registry.other_versions(e.name))
                          for e in registry.entries()
                          if e.name == message.model), None)
            ingress.writer.send(Resolved(message.ask_id, entry))
        elif isinstance(message, ControlCall):
            self._on_control(ingress, message)
        elif isinstance(message, Hello):
            ingress.source = message.source
            if isinstance(message.pid, int) and ingress.leases is None:
                ingress.leases = TensorLeases(message.pid, ingress.releases)
            log.info("ingress %d (pid %d) connected", message.index, message.pid,
                     extra={"event": "ingress_connected", "ingress": message.index, "pid": message.pid})
        else:
            log.warning("ignored an unknown message from an ingress: %s", type(message).__name__)

    def _on_control(self, ingress: _Ingress, call: ControlCall) -> None:
        op = call.op
        if self._control is None or not isinstance(op, ControlOp):
            log.warning("refused a control call of %s from an ingress", quote(type(op).__name__))
            ingress.writer.send(ControlReply(call.ask_id, error=ServeError(
                f"the engine answers no control operation {quote(type(op).__name__)}")))
            return
        token = request_id_var.set(call.request_id)  # the handler's task copies it: its log lines name the request
        try:
            task = asyncio.ensure_future(self._control.run(op))
        finally:
            request_id_var.reset(token)
        self._control_tasks.add(task)
        task.add_done_callback(partial(self._control_done, ingress, call))

    def _control_done(self, ingress: _Ingress, call: ControlCall, task: asyncio.Future[Any]) -> None:
        self._control_tasks.discard(task)
        if task.cancelled():
            self._reply_control(ingress, call, None, ServeError("the engine stopped before the operation finished"))
        else:
            error = task.exception()
            self._reply_control(ingress, call, task.result() if error is None else None, error)

    def _reply_control(self, ingress: _Ingress, call: ControlCall, result: Any, error: BaseException | None) -> None:
        if ingress.closed:
            return
        pickled = None
        if error is None:
            # Pickled here, once (the frame then copies the bytes): an unpicklable result must not take
            # the frame, and other requests' outcomes, with it.
            try:
                pickled = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                error = exc
        if error is not None and not isinstance(error, ServeError):
            log.error("control operation %s failed: %r", type(call.op).__name__, error)
            error = ServeError(f"the engine failed: {error}")
        ingress.writer.send(ControlReply(call.ask_id, result=pickled if error is None else None, error=error))

    def _on_envelope(self, ingress: _Ingress, envelope: Envelope, stream: bool = False) -> None:
        request = envelope.request
        token = request_id_var.set(request.id)  # names the request in the engine's log lines
        placement = BatchPlacement()  # filled by the scheduler's telemetry; goes back with the outcome
        placement_token = placement_var.set(placement)
        trace_token = None
        if request.traceparent:
            trace_token = otel_context.attach(extract({"traceparent": request.traceparent}))
        try:
            if envelope.shared is not None:
                request = request._replace(inputs=self._shared_inputs(ingress, envelope.shared))
            future = self._engine.submit_stream(request, DoorPartSink(ingress, envelope.call_id)) if stream \
                else self._engine.submit(request)
        except ServeError as exc:
            ingress.writer.send(Outcome(envelope.call_id, error=exc, placement=placement))
            return
        except Exception as exc:  # a bug must still answer the request
            log.exception("envelope for model %s failed", request.model)
            ingress.writer.send(Outcome(envelope.call_id, error=ModelError(f"the engine failed: {exc}")))
            return
        finally:
            if trace_token is not None:
                otel_context.detach(trace_token)
            placement_var.reset(placement_token)
            request_id_var.reset(token)
        ingress.pending[envelope.call_id] = future
        future.add_done_callback(partial(self._answer, ingress, envelope.call_id, placement))

    @staticmethod
    def _shared_inputs(ingress: _Ingress, shared: SharedTensors) -> dict[str, Any]:
        """The envelope's inputs, read in place from the ingress's shared memory."""
        if ingress.leases is None:  # no Hello yet: whose memory this is cannot be checked
            ingress.writer.send(Release((shared.block,)))
            raise ServeError("shared tensors from an ingress that has not said who it is")
        try:
            return ingress.leases.arrays(shared)
        except ValueError as exc:
            log.error("refused shared tensors from ingress %s: %s", ingress.source, exc)
            raise ServeError(f"the request's tensors could not be read from shared memory: {exc}") from None

    def _answer(self, ingress: _Ingress, call_id: int, placement: BatchPlacement,
                future: asyncio.Future[RequestResult]) -> None:
        ingress.pending.pop(call_id, None)
        if ingress.closed or future.cancelled():
            return  # a cancel from the ingress: it answered its client already
        error = future.exception()
        if error is None:
            result = future.result()
            shared = None
            size = tensor_bytes(result.outputs)
            if ingress.outputs is not None and size >= max(1, self._shared_min):
                if size >= OFF_LOOP_BYTES:  # a large result is copied on the copy thread (issue 45 H1)
                    self._answer_off_loop(ingress, call_id, placement, result, ingress.outputs)
                    return
                shared = ingress.outputs.put(result.outputs)
                if shared is not None:
                    result = dataclasses.replace(result, outputs={})
            ingress.writer.send(Outcome(call_id, result=result, placement=placement, shared=shared))
        elif isinstance(error, ServeError):
            ingress.writer.send(Outcome(call_id, error=error, placement=placement))
        else:
            ingress.writer.send(Outcome(call_id, error=ModelError(f"the request failed: {error}"), placement=placement))

    def _answer_off_loop(self, ingress: _Ingress, call_id: int, placement: BatchPlacement, result: RequestResult,
                         store: TensorStore) -> None:
        """`result`'s outputs written into the ingress's shared memory on the copy thread, then its
        outcome sent (inline when they found no room there)."""
        copying = asyncio.ensure_future(COPIES.run(partial(store.put, result.outputs)))
        self._copies.add(copying)

        def written(task: asyncio.Future[SharedTensors | None]) -> None:
            self._copies.discard(task)
            shared = None if task.cancelled() or task.exception() is not None else task.result()
            if ingress.closed:
                store.abandon()  # abandoned meanwhile, perhaps before this block: no segment is left behind
                return
            answer = result if shared is None else dataclasses.replace(result, outputs={})
            ingress.writer.send(Outcome(call_id, result=answer, placement=placement, shared=shared))

        copying.add_done_callback(written)

    def _on_lost(self, ingress: _Ingress, exc: BaseException | None) -> None:
        if ingress.closed:
            return
        ingress.close()
        self._ingresses.discard(ingress)
        for future in list(ingress.pending.values()):
            future.cancel()  # its client is gone with its ingress: drop what has not run
        ingress.pending.clear()
        if ingress.source and self._retire is not None:
            self._retire(ingress.source)
        log.info("ingress %s disconnected%s", ingress.source or "(unnamed)", f": {exc}" if exc else "",
                 extra={"event": "ingress_disconnected", "source": ingress.source})

    def _table_change(self, table: ModelTable) -> ModelTable | None:
        """What changed since the last push (None: nothing). An ingress that connected since got the
        whole table then, newer than the last push: applying this on top of it changes nothing twice."""
        prints = {name: _fingerprint(entry) for name, entry in table.models.items()}
        head = (table.default_model, table.readiness, table.accepting)
        last = self._last_prints
        changed = {name: table.models[name] for name, p in prints.items() if last.get(name) != p}
        removed = tuple(name for name in last if name not in prints)
        if not changed and not removed and head == self._last_head:
            return None
        self._last_prints, self._last_head = prints, head
        return ModelTable(changed, table.default_model, table.readiness, table.accepting, complete=False,
                          removed=removed)

    async def _watch_table(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(TABLE_POLL_S)
            if not self._ingresses:
                continue
            try:
                key = self._engine.views.table_key()
                change = None if key == self._last_key else self._table_change(model_table(self._engine))
            except Exception:  # never let the watcher die
                log.exception("building the model table failed")
                continue
            self._last_key = key
            ticks += 1
            for ingress in self._ingresses:
                if ingress.outputs is not None:
                    ingress.outputs.trim_if_idle()  # a burst's segments go once it is over
                if ingress.leases is not None and ticks % _PRUNE_EVERY_TICKS == 0:
                    ingress.leases.prune()  # and the ingress's trimmed ones are not kept mapped here
            if change is not None:
                for ingress in self._ingresses:
                    ingress.writer.send(change)
            live = self._live()
            live_print = (id(live.settings), id(live.keys), live.default_rate_per_s)
            if live_print != self._last_live:
                self._last_live = live_print
                for ingress in self._ingresses:
                    ingress.writer.send(live)


def _lane_state(change: BoardChange, rank: int, ingresses: int) -> LaneState:
    """What the `rank`th of `ingresses` ingress processes is told of one published lane
    (engine/full_lanes.py): its share of the places still free, which it may promise to requests
    it is reading or decoding (engine/promised.py). The shares add up to the places free, so the
    ingress processes together never let more requests through than the lane can queue; a share
    left unused is dealt again at the lane's next change."""
    model, version, lane, refusals = change
    if refusals is None:
        return LaneState(model, version, lane, None)
    share = refusals.free // ingresses + (1 if rank < refusals.free % ingresses else 0)
    return LaneState(model, version, lane, refusals.held, refusals.depth, refusals.retry_after_s, share)
