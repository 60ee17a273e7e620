"""servewell's OTLP encoder writes exactly what the SDK's encoder does, decoded with the official
opentelemetry-proto messages, for every span shape the SDK produces; its exporter posts them,
retries what the specification says to retry, and gives up within its timeout."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from servewell.observability.otlp import OtlpHttpSpanExporter, _headers, encode_spans


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


def test_encoding_equals_the_sdk_encoder():
    spans = make_spans()
    assert len(spans) == 7
    assert any(s.dropped_attributes and s.dropped_events and s.events for s in spans)
    assert any(s.dropped_links for s in spans)
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert ours == sdk_encode_spans(spans)
    assert len(ours.resource_spans) == 2  # grouped by resource, then by scope, as the SDK does
    (http,) = [s for s in ours.resource_spans[0].scope_spans[0].spans if s.name == "http"]
    assert http.attributes[-1].value.string_value == "é ü" and http.trace_state == "vendor=v1,k=2"


def test_an_attribute_that_cannot_be_encoded_is_left_out():
    finished = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(finished))
    span = provider.get_tracer("t").start_span("s", attributes={"ok": 1})
    span._attributes._dict["huge"] = 2**70  # noqa: SLF001 - the SDK would not let it in
    span.end()
    (decoded,) = ExportTraceServiceRequest.FromString(encode_spans(finished.get_finished_spans())) \
        .resource_spans[0].scope_spans[0].spans
    assert [a.key for a in decoded.attributes] == ["ok"]


class Receiver:
    """An OTLP/HTTP endpoint that answers each POST with the next status in `statuses`."""

    def __init__(self, statuses: list[int]) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.bodies.append(raw)
                receiver.headers.append(dict(self.headers))
                status = statuses.pop(0) if statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):  # noqa: ANN002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_exporter_posts_gzip_with_headers_and_retries_what_is_retryable():
    spans = make_spans()
    receiver = Receiver([503, 200, 400])
    exporter = OtlpHttpSpanExporter(receiver.url, 2.0, {"authorization": "Bearer t"}, "gzip")
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS  # 503, then 200
        assert len(receiver.bodies) == 2
        decoded = ExportTraceServiceRequest.FromString(gzip.decompress(receiver.bodies[-1]))
        assert decoded == sdk_encode_spans(spans)
        assert receiver.headers[-1]["authorization"] == "Bearer t"
        assert receiver.headers[-1]["Content-Type"] == "application/x-protobuf"
        assert exporter.export(spans) == SpanExportResult.FAILURE  # 400: not retried
        assert len(receiver.bodies) == 3
    finally:
        exporter.shutdown()
        receiver.server.shutdown()


def test_exporter_gives_up_on_an_unreachable_collector_within_its_timeout():
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(1)  # accepts into the backlog, never reads
    exporter = OtlpHttpSpanExporter(f"http://127.0.0.1:{blackhole.getsockname()[1]}/v1/traces", timeout_s=0.5)
    try:
        started = time.monotonic()
        assert exporter.export(make_spans()) == SpanExportResult.FAILURE
        assert time.monotonic() - started < 2.0
    finally:
        exporter.shutdown()
        blackhole.close()


def test_headers_from_the_environment_format():
    assert _headers("api-key=a%20b, X-Tenant = t1,broken") == {"api-key": "a b", "x-tenant": "t1"}


def test_exporter_refuses_a_non_http_endpoint():
    with pytest.raises(ValueError):
        OtlpHttpSpanExporter("localhost:4317")


def test_failures_are_logged_once_a_minute_with_what_was_dropped(caplog):
    receiver = Receiver([400, 400, 400])
    exporter = OtlpHttpSpanExporter(receiver.url, 2.0)
    spans = make_spans()
    try:
        with caplog.at_level("WARNING", logger="servewell.tracing"):
            for _ in range(3):
                assert exporter.export(spans) == SpanExportResult.FAILURE
        reports = [r.getMessage() for r in caplog.records if r.name == "servewell.tracing"]
        assert len(reports) == 1 and "HTTP 400" in reports[0] and f"{len(spans)} spans dropped" in reports[0]
    finally:
        exporter.shutdown()
        receiver.server.shutdown()
