"""servewell's OTLP encoder writes exactly what the SDK's encoder does, decoded with the official
opentelemetry-proto messages, for every span shape the SDK produces."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from otlp_spans import make_spans
from servewell.observability.otlp import OtlpHttpSpanExporter, _headers, encode_spans


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
    # A finished span built by hand: the SDK's tracer would not let an int beyond 64 bits in.
    span = ReadableSpan("s", SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(1)),
                        attributes={"ok": 1, "huge": 2**70}, start_time=1, end_time=2)
    (decoded,) = ExportTraceServiceRequest.FromString(encode_spans([span])).resource_spans[0].scope_spans[0].spans
    assert [a.key for a in decoded.attributes] == ["ok"]


def test_headers_from_the_environment_format():
    assert _headers("api-key=a%20b, X-Tenant = t1,broken") == {"api-key": "a b", "x-tenant": "t1"}


def test_exporter_refuses_a_non_http_endpoint():
    with pytest.raises(ValueError):
        OtlpHttpSpanExporter("localhost:4317")


def test_the_resource_hashes_once_and_still_equals_the_sdk_one():
    from opentelemetry.sdk.resources import Resource

    from servewell.observability.resource import HashedResource

    plain = Resource.create({"service.name": "servewell"})
    hashed = HashedResource(plain.attributes, plain.schema_url)
    assert hashed == plain and hash(hashed) == hash(plain)
    assert {plain: 1}[hashed] == 1 and hashed.attributes["service.name"] == "servewell"


def test_a_span_without_a_context_is_left_out():
    assert encode_spans([ReadableSpan("no-context")]) == b""
