"""`trace_step("name")`: a span and a histogram sample around a block of model-author code.

    from servewell import trace_step

    with trace_step("tokenize"):
        ...

Inside a worker, durations travel back with the batch and land in the frontend's
`servewell_trace_step_seconds{step}` histogram; in the frontend they are observed directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace

StepSink = Callable[[str, float], None]

_sink: StepSink | None = None
_tracer: trace.Tracer | None = None


def set_step_sink(sink: StepSink | None, tracer: trace.Tracer | None = None) -> None:
    """Where this process sends step durations and spans (set once at process start; without a
    tracer, the global OpenTelemetry one)."""
    global _sink, _tracer
    _sink = sink
    _tracer = tracer


@contextmanager
def trace_step(name: str) -> Iterator[None]:
    """Time the block as a histogram sample and, inside a recorded trace, as a span named `name`
    (a child of the current span)."""
    started = time.perf_counter()
    # A span only inside a recorded trace: an unsampled request's steps cost no span.
    span: AbstractContextManager[object]
    if trace.get_current_span().is_recording():
        tracer = _tracer if _tracer is not None else trace.get_tracer("servewell.steps")
        span = tracer.start_as_current_span(name)
    else:
        span = nullcontext()
    with span:
        try:
            yield
        finally:
            if _sink is not None:
                _sink(name, time.perf_counter() - started)
