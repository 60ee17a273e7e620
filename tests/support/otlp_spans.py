"""Finished SDK spans of every shape the OTLP encoders must agree on."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)


def make_spans():
    finished = InMemorySpanExporter()
    providers = [
        TracerProvider(resource=Resource.create({"service.name": "a", "n": 3, "f": 0.5, "ok": True}),
                       span_limits=SpanLimits(max_attributes=14, max_events=2, max_links=2)),
        TracerProvider(resource=Resource({"service.name": "b"}, schema_url="https://opentelemetry.io/schemas/1.21.0")),
    ]
    for provider in providers:
        provider.add_span_processor(SimpleSpanProcessor(finished))
    a, b = providers
    tracer = a.get_tracer("servewell")
    versioned = a.get_tracer("other", "1.2.3", schema_url="https://example.com/s", attributes={"lib": "x"})
    remote = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", "v1"), ("k", "2")]))
    remote_parent = trace.set_span_in_context(NonRecordingSpan(remote))
    with tracer.start_as_current_span("http", context=remote_parent, kind=SpanKind.SERVER, attributes={
        "str": "é ü", "int": 200, "neg": -5, "big": 2**62, "float": 1.25, "bool": False, "bytes": b"\x00\xff",
        "strs": ["a", "b"], "ints": (1, 2, 3), "empty": [],
    }) as http:
        http.add_event("first", {"n": 1}, timestamp=123)
        http.add_event("second")
        http.add_event("third, over the limit")
        http.set_status(Status(StatusCode.ERROR, "boom"))
        for i in range(8):  # over max_attributes: dropped counts
            http.set_attribute(f"extra{i}", i)
        http.set_attribute("unicode", "é ü")
        with tracer.start_as_current_span("preprocess", kind=SpanKind.INTERNAL):
            pass
    links = [Link(http.get_span_context(), {"why": "batched"}), Link(remote), Link(remote)]  # one over the limit
    tracer.start_span("batch", links=links, kind=SpanKind.PRODUCER, start_time=10).end(end_time=20)
    ok = tracer.start_span("ok", kind=SpanKind.CLIENT)
    ok.set_status(Status(StatusCode.OK))
    ok.end()
    with versioned.start_as_current_span("", kind=SpanKind.CONSUMER):  # empty name
        pass
    with b.get_tracer("b-lib").start_as_current_span("other resource"):
        pass
    with tracer.start_as_current_span("back to the first"):
        pass
    return finished.get_finished_spans()
