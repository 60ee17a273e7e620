"""What every route needs: the engine, the limits, and the pool that decodes images."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from opentelemetry import trace

from servewell.api.codecs.image import image_to_array
from servewell.config.model import ModelConfig
from servewell.config.server import ServerConfig
from servewell.engine.engine import InferenceEngine
from servewell.engine.scheduler import RequestResult
from servewell.errors import ClientClosed, InvalidInput
from servewell.observability.context import stages_var
from servewell.observability.metrics import ServeMetrics
from servewell.observability.tracing import Tracing

URGENCY_HEADER = "x-urgency"
TIMEOUT_HEADER = "x-request-timeout-ms"


@dataclass(slots=True)
class ApiContext:
    """Shared state of the HTTP layer."""

    engine: InferenceEngine
    settings: ServerConfig
    decode_pool: ThreadPoolExecutor
    metrics: ServeMetrics | None
    tracing: Tracing

    def record_stages(self, model: str, result: RequestResult, preprocess_s: float, postprocess_s: float) -> None:
        """Per-request stage durations: into the histograms, and for the middleware's slow-request log."""
        if self.metrics is not None:
            self.metrics.preprocess.labels(model).observe(preprocess_s)
            self.metrics.postprocess.labels(model).observe(postprocess_s)
        stages = stages_var.get()
        if stages is not None:
            stages.update(preprocess=preprocess_s, queue=result.queue_s, compute=result.compute_s,
                          postprocess=postprocess_s)

    async def decode_images(self, config: ModelConfig, blobs: list[bytes]) -> np.ndarray:
        """Decode encoded images into one input batch, off the event loop."""
        spec = config.preprocess
        if spec is None:
            raise InvalidInput(f"model '{config.name}' declares no image preprocessing, so it takes no images")
        limit = self.settings.max_image_pixels

        def work() -> np.ndarray:
            return np.stack([image_to_array(blob, spec, limit) for blob in blobs])

        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, work)


def stage_span(api: ApiContext, name: str, model: str):  # noqa: ANN201 - a context manager
    """A span for a request stage, only when the request is sampled (unsampled ones pay nothing)."""
    if not api.tracing.enabled or not trace.get_current_span().is_recording():
        return contextlib.nullcontext()
    return api.tracing.tracer.start_as_current_span(name, attributes={"servewell.model": model})


def api_context(request: Request) -> ApiContext:
    """The shared context (a FastAPI dependency, and called directly on the hot routes, where
    dependency solving would cost more than the lookup)."""
    return request.app.state.api


def lane_from(request: Request, urgency: str | None = None) -> str | None:
    """Lane of a request: the `X-Urgency` header or the body's urgency; None is the default lane."""
    header = request.headers.get(URGENCY_HEADER, "").strip().lower()
    if header:
        return header
    return urgency


def timeout_from_header(request: Request) -> float | None:
    """Deadline in ms from `X-Request-Timeout-Ms`, if given (422 when not a positive number)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise InvalidInput(f"header X-Request-Timeout-Ms must be a positive number of milliseconds, got {raw!r}")
    return value


def server_timing(queue_s: float, preprocess_s: float, compute_s: float, postprocess_s: float, total_s: float) -> str:
    """`Server-Timing` header value, durations in milliseconds."""
    return (
        f"preprocess;dur={preprocess_s * 1000:.3f}, queue;dur={queue_s * 1000:.3f}, "
        f"compute;dur={compute_s * 1000:.3f}, postprocess;dur={postprocess_s * 1000:.3f}, "
        f"total;dur={total_s * 1000:.3f}"
    )


async def unless_disconnected(request: Request, future: asyncio.Future[RequestResult]) -> RequestResult:
    """Await the request's future; if the client disconnects first, cancel it, so a queued request
    is dropped before it costs compute. The body has been read, so the next ASGI message is the
    disconnect. One watcher task per request; the future itself is awaited directly."""
    watcher = asyncio.ensure_future(_disconnect(request))
    watcher.add_done_callback(lambda w: w.cancelled() or future.cancel())
    try:
        return await future
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientClosed("the client disconnected before the result was ready") from None
        raise
    finally:
        watcher.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
