"""The one inference path every protocol calls.

A route (HTTP `/predict`, HTTP `/v2/.../infer`, gRPC `ModelInfer`) does only what is specific to
its wire format: read the body, parse it into tensors, encode the answer. Everything else runs
here, in this order, the same for all of them:

1. `DataPlane.call()` at arrival: the clocks the deadline and `Server-Timing` count from;
2. `InferenceCall.open(name, version, urgency)`: resolve the model once, pick the lane, admit
   (refused before the body is decoded when the model is not ready or the lane is full);
3. `preprocessing()` around the protocol's decoding, with `decode_images` / `model_inputs` for
   what is common (encoded images through the decode pool, datatype checks);
4. `infer(...)`: final lane (OIP priority), deadline, submit, and cancellation when the client goes;
5. `encode(outputs, steps)` (or `postprocessing()` around encoding), then `finish()`: stage metrics and
   the `Server-Timing` value.

A large answer is encoded in steps with the event loop taking a turn between them (`encode`):
a 60 MB answer is 0.7-1.5 s of JSON encoding, and a 4-float model's requests through the same
ingress waited for all of it (issue 45 H1). Not on a thread: orjson holds the GIL for a whole
call, and the loop, which gives the GIL up at every socket call, had to win it back each time (a
4-float probe through the same ingress still waited up to 1.9 s with the encoding on a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context

from servewell.api.codecs.image import ImageLimits, decode_base64, decode_planned, plan_decode
from servewell.api.codecs.tensors import DecodedTensor
from servewell.api.decode_scheduler import DecodeScheduler
from servewell.config.model import ModelConfig
from servewell.engine.promised import Promise
from servewell.engine.protocol import RequestResult, ServedModel, ServingEngine
from servewell.engine.request import InferenceRequest
from servewell.errors import ClientClosed, InvalidInput, Overloaded, ServeError, quote
from servewell.observability.context import (
    client_var,
    model_var,
    request_id_var,
    request_trace_var,
    route_key_var,
    stages_var,
)
from servewell.observability.metrics import ServeMetrics
from servewell.observability.tracing import Tracing, traceparent_of

T = TypeVar("T")

#: An answer whose tensors hold this many bytes or more is encoded in steps, the loop taking a turn
#: between them; a smaller one at once (a turn of the loop costs more than encoding it).
ENCODE_IN_STEPS_BYTES = 1 << 20


class DataPlane:
    """Shared by every protocol of one server."""

    def __init__(self, engine: ServingEngine, decoder: DecodeScheduler, image_limits: ImageLimits,
                 metrics: ServeMetrics | None, tracing: Tracing,
                 tenant_of: Callable[[str], str] = lambda key_id: "") -> None:
        self.engine = engine
        self._decoder = decoder
        self._image_limits = image_limits
        self._metrics = metrics
        self._tracing = tracing
        self.tenant_of = tenant_of  # an API key id's tenant (api/keys.py), read per request: keys change live

    def call(self) -> InferenceCall:
        """Start one inference request (call it first: its clocks start now)."""
        return InferenceCall(self)

    def note_model(self, name: str) -> None:
        """Name the request's model in its logs and metrics, if it is one of ours: a client cannot
        mint label values or log fields with made-up names."""
        if self.engine.knows(name):
            model_var.set(name)

    def check_decode(self, urgent: bool) -> None:
        """Refuse (503 `overloaded`) now when an image decode could not even wait: for a route that
        only takes images, before it reads the body."""
        self._decoder.check(urgent)

    async def decode_images(self, config: ModelConfig, blobs: Sequence[bytes], urgent: bool = False) -> np.ndarray:
        """Decode encoded images into one input batch for `config`: headers checked here (limits,
        cost), pixels decoded in the decode pool in `DecodeScheduler` order (urgent first)."""
        spec = config.preprocess
        if spec is None:
            raise InvalidInput(f"model '{config.name}' declares no image preprocessing, so it takes no images")
        planned = [plan_decode(blob, spec, self._image_limits) for blob in blobs]

        def work() -> np.ndarray:
            return np.stack([decode_planned(p, spec) for p in planned])

        return await self._decoder.run(work, pixels=sum(p.pixels for p in planned), urgent=urgent)

    def count(self, model: ServedModel, lane: int, outcome: str) -> None:
        """Count one request of `model` that ended in the data plane (before the scheduler)."""
        if self._metrics is not None:
            lanes = model.config.batching.lanes
            self._metrics.count(model.name, lanes[lane] if lane < len(lanes) else str(lane), outcome)

    def admit_early(self, name: str, version: str | None, urgency: str | None,
                    tenant: str) -> Literal[True] | Promise | None:
        """True when `InferenceCall.open` will refuse this request (its model known to this process
        now, without asking another), else its promise of a place in the lane, which its request
        holds while its body arrives: the check `api/early_refusal.py` runs on a request's head."""
        try:
            model = self.engine.resolve_now(name, version)
            if model is None:
                return None
            return model.admit(model.resolve_lane(urgency), tenant)
        except ServeError:
            return True

    def refused(self, model: ServedModel, lane: int, tenant: str, error: ServeError) -> None:
        """Count a refusal (429, 503) of `tenant`'s request before it reached the engine, as the
        engine counts its own (`servewell_refusals_total`), and name the tenant on its error."""
        if error.status not in (429, 503):
            return
        if error.tenant is None:
            error.tenant = tenant
        if self._metrics is not None:
            lanes = model.config.batching.lanes
            self._metrics.count_refusal(model.name, lanes[lane] if lane < len(lanes) else str(lane), tenant,
                                        error.code)

    def record(self, model: str, result: RequestResult, preprocess_s: float, postprocess_s: float) -> None:
        """Per-request stage durations: into the histograms, and for the slow-request log."""
        if self._metrics is not None:
            self._metrics.preprocess.labels(model).observe(preprocess_s)
            self._metrics.postprocess.labels(model).observe(postprocess_s)
        stages = stages_var.get()
        if stages is not None:
            stages.update(preprocess=preprocess_s, queue=result.queue_s, compute=result.compute_s,
                          postprocess=postprocess_s)
            if result.load_s:  # it waited for its model to load: the slow-request record says so
                stages["load"] = result.load_s
            for step in result.steps:  # a pipeline's: each step's own time (skipped steps: 0)
                stages[f"step.{step.step}"] = step.total_s

    def stage_span(self, name: str, model: str) -> contextlib.AbstractContextManager[object]:
        """A span for a request stage, only when the request is sampled (unsampled ones pay nothing)."""
        if not self._tracing.enabled or not trace.get_current_span().is_recording():
            return contextlib.nullcontext()
        return self._tracing.tracer.start_as_current_span(name, attributes={"servewell.model": model})


class InferenceCall:
    """One request on its way through the data plane."""

    __slots__ = ("_plane", "_started", "arrived_at", "_model", "_version", "_urgency", "_lane", "_key_id", "_tenant",
                 "_promise", "preprocess_s", "postprocess_s")

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane
        self._started = time.perf_counter()
        #: The one deadline clock: `loop.time()` == `time.monotonic()` seconds (uvloop: in whole ms).
        self.arrived_at = asyncio.get_running_loop().time()
        self._model: ServedModel | None = None
        self._version: str | None = None
        self._urgency: str | None = None
        self._lane = 0
        self._key_id = ""
        self._tenant = ""
        # Its place in the lane, promised by `open` while the request is read and decoded: dropped
        # when the request is built, or with this call (engine/promised.py).
        self._promise: Promise | None = None
        self.preprocess_s = 0.0
        self.postprocess_s = 0.0

    @property
    def model(self) -> ServedModel:
        """The model `open` resolved."""
        if self._model is None:
            raise RuntimeError("InferenceCall.open() must come first")
        return self._model

    async def open(self, name: str, version: str | None = None, urgency: str | None = None) -> ServedModel:
        """Resolve the model, choose the lane from `urgency`, and run the admission checks that can
        refuse before the body is read (the model taking no requests, a full lane its tenant holds
        most of beyond its share, the server shutting down)."""
        self._plane.note_model(name)
        model = await self._plane.engine.resolve_async(name, version)
        self._model, self._version, self._urgency = model, version or None, urgency
        self._key_id = client_var.get()
        self._tenant = self._plane.tenant_of(self._key_id)
        self._lane = model.resolve_lane(urgency)
        try:
            self._promise = model.admit(self._lane, self._tenant)
        except ServeError as error:  # refused before the body was read: counted here, for its tenant
            self._plane.refused(model, self._lane, self._tenant, error)
            raise
        return model

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Around reading the request after `open`: a client that leaves now is counted as a
        `cancelled` request of its model (the scheduler counts those that leave later)."""
        try:
            yield
        except ClientClosed:
            self._plane.count(self.model, self._lane, "cancelled")
            raise

    @contextlib.contextmanager
    def preprocessing(self) -> Iterator[None]:
        """Times (and, when sampled, spans) the protocol's decoding of the request."""
        started = time.perf_counter()
        with self._plane.stage_span("preprocess", self.model.name):
            try:
                yield
            finally:
                self.preprocess_s += time.perf_counter() - started

    @contextlib.contextmanager
    def postprocessing(self) -> Iterator[None]:
        """Times the protocol's encoding of the answer."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.postprocess_s += time.perf_counter() - started

    async def encode(self, outputs: Mapping[str, np.ndarray], steps: Generator[None, None, T]) -> T:
        """Run the protocol's encoding of the answer `outputs`, given as `steps` (a generator that
        yields between bounded pieces of work and returns the encoded answer), timed as
        postprocessing: at once when the answer is small, else with the event loop taking a turn
        between steps, so a large answer never holds the loop every other request needs."""
        with self.postprocessing():
            stepwise = sum(array.nbytes for array in outputs.values()) >= ENCODE_IN_STEPS_BYTES
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    result: T = done.value
                    return result
                if stepwise:
                    await asyncio.sleep(0)

    async def decode_images(self, blobs: Sequence[bytes]) -> np.ndarray:
        """Encoded images to the model's image input batch (off the event loop)."""
        config = self.model.config
        limit = config.max_batch_size or 1
        if len(blobs) > limit:
            raise InvalidInput(f"{len(blobs)} images in one request; model '{config.name}' takes at most {limit}")
        try:
            batch = await self._plane.decode_images(config, blobs, urgent=self._lane == 0)
        except Overloaded:
            self._plane.count(self.model, self._lane, "rejected")
            raise
        spec = config.input_spec(config.image_input or "")
        return batch.astype(spec.numpy_dtype, copy=False) if spec is not None else batch

    async def model_inputs(self, tensors: Sequence[DecodedTensor], priority: object = None) -> dict[str, np.ndarray]:
        """OIP tensors to model inputs: names and datatypes checked, encoded images (BYTES sent to the
        model's image input) decoded with the model's preprocessing, in the order of the lane that
        `priority` (OIP) picks unless the request's urgency already did."""
        config = self.model.config
        if priority is not None and not self._urgency:
            self._lane = self.model.resolve_lane(None, priority)
        inputs: dict[str, np.ndarray] = {}
        for tensor in tensors:
            if tensor.name in inputs:  # the later one would silently win: refused for HTTP and gRPC alike
                raise InvalidInput(f"input {quote(tensor.name)} is given more than once; send each input once")
            spec = config.input_spec(tensor.name)
            if spec is None:
                raise InvalidInput(f"unknown input {quote(tensor.name)}; model '{config.name}' takes "
                                   f"{[t.name for t in config.inputs]}")
            if tensor.datatype == "BYTES" and spec.datatype != "BYTES" and config.image_input == tensor.name:
                # Encoded images: raw bytes in binary form, base64 strings in JSON.
                blobs = [bytes(b) for b in tensor.array.reshape(-1)]
                if not tensor.from_binary:
                    blobs = [decode_base64(b.decode("ascii", "replace"), tensor.name) for b in blobs]
                if not blobs:
                    raise InvalidInput(f"input '{tensor.name}' holds no images")
                inputs[tensor.name] = await self.decode_images(blobs)
            elif tensor.datatype != spec.datatype:
                raise InvalidInput(f"input '{tensor.name}' has datatype {quote(tensor.datatype)}, model "
                                   f"'{config.name}' expects {spec.datatype}")
            else:
                inputs[tensor.name] = tensor.array
        return inputs

    async def infer(self, inputs: dict[str, np.ndarray], *, priority: object = None, timeout_ms: float | None = None,
                    disconnected: Awaitable[None] | None = None, not_after: float | None = None,
                    oip_id: str | None = None) -> RequestResult:
        """Queue the request and wait for its result. `priority` (OIP) picks the lane unless the
        request's urgency already did; `timeout_ms` (the client's, counted from arrival; None: the
        model's default) becomes the request's one absolute deadline here, bounded by `not_after`
        (absolute, same clock: a gRPC caller's own deadline); `disconnected` completes when the
        client goes away, which drops a request that has not run yet (`ClientClosed`); `oip_id`:
        the client's OIP request id, which the payload log keeps beside the request id."""
        request = self.request_for(inputs, priority=priority, timeout_ms=timeout_ms, not_after=not_after, oip_id=oip_id)
        future = self._plane.engine.submit(request)
        watcher: asyncio.Future[None] | None = None
        if disconnected is not None:
            watcher = asyncio.ensure_future(disconnected)
            watcher.add_done_callback(functools.partial(_cancel_unless_cancelled, future))
        try:
            return await future
        except asyncio.CancelledError:
            if watcher is not None and watcher.done() and not watcher.cancelled():
                raise ClientClosed("the client disconnected before the result was ready") from None
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            # A failed future holds its error, the error its traceback, the traceback this frame:
            # while the frame holds the future (or the watcher, whose callback holds it), that is a
            # reference cycle per refused request, left to the cyclic collector, whose young
            # collections paused a flooded ingress process 10-30 ms at a time.
            del future, watcher

    def request_for(self, inputs: dict[str, np.ndarray], *, priority: object = None, timeout_ms: float | None = None,
                    not_after: float | None = None, oip_id: str | None = None,
                    max_outputs: int = 0) -> InferenceRequest:
        """The one request object for these inputs (`infer`'s rules for the lane and the absolute
        deadline; a stream's calls it too: api/stream_call.py)."""
        model = self.model
        self._promise = None  # the request is built: it is the engine's to queue now
        lane = self._lane if priority is None or self._urgency else model.resolve_lane(None, priority)
        deadline = self.arrived_at + (timeout_ms / 1000.0 if timeout_ms is not None else model.default_timeout_s)
        if not_after is not None:
            deadline = min(deadline, not_after)
        return InferenceRequest(request_id_var.get(), model.name, self._version, lane, deadline, self.arrived_at,
                                inputs, self._tenant, self._key_id, route_key_var.get(), _traceparent(), oip_id,
                                max_outputs=max_outputs)

    @property
    def plane(self) -> DataPlane:
        """The data plane this call runs on."""
        return self._plane

    def finish(self, result: RequestResult) -> str:
        """Record the request's stages; the `Server-Timing` header value (milliseconds)."""
        self._plane.record(self.model.name, result, self.preprocess_s, self.postprocess_s)
        total_s = time.perf_counter() - self._started
        timing = (
            f"preprocess;dur={self.preprocess_s * 1000:.3f}, queue;dur={result.queue_s * 1000:.3f}, "
            f"compute;dur={result.compute_s * 1000:.3f}, postprocess;dur={self.postprocess_s * 1000:.3f}, "
            f"total;dur={total_s * 1000:.3f}"
        )
        if result.steps:  # a pipeline: one entry per step (step names are tokens: letters, digits, - and _)
            timing += "".join(f", step.{s.step};dur={s.total_s * 1000:.3f};desc={s.outcome}" for s in result.steps)
        if result.load_s:  # a cold start: the time it waited for its model to load
            timing += f", load;dur={result.load_s * 1000:.3f}"
        config = self.model.config
        cache = result.cache or ("miss" if config.cache is not None and config.deterministic else "")
        return f"{timing}, cache;desc={cache}" if cache else timing


def _traceparent() -> str | None:
    """The W3C trace context of the current request's span, when it is sampled (it goes with the
    request to the engine, whose batch span links to it)."""
    request_trace = request_trace_var.get()  # the request's own span (the middleware keeps it there)
    span_context = trace.get_current_span(request_trace if isinstance(request_trace, Context) else None) \
        .get_span_context()
    return traceparent_of(span_context) if span_context.is_valid and span_context.trace_flags.sampled else None


def select_outputs(model: str, outputs: dict[str, np.ndarray],
                   requested: Sequence[str] | None) -> dict[str, np.ndarray]:
    """The outputs a request asked for, in its order (all when it named none)."""
    if requested is None:
        return outputs
    unknown = [name for name in requested if name not in outputs]
    if unknown:
        raise InvalidInput(f"unknown output {quote(unknown[0])}; model '{model}' has {list(outputs)}")
    return {name: outputs[name] for name in requested}


def _cancel_unless_cancelled(future: asyncio.Future[Any], watcher: asyncio.Future[None]) -> None:
    """The disconnect watcher's callback: a client that went away cancels its request."""
    if not watcher.cancelled():
        future.cancel()
