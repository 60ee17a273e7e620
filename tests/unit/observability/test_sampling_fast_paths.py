"""Unsampled work makes no span even where the tracer would record every span it is asked for:
the frontend decides root sampling itself, and trace_step follows the current trace."""

import asyncio

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from servewell.api.middleware import RequestContextMiddleware
from servewell.api.state import LiveKnobs
from servewell.observability.steps import set_step_sink, trace_step
from servewell.observability.tracing import Tracing, TracingSettings

UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def recording_tracing(ratio: float) -> tuple[Tracing, InMemorySpanExporter]:
    """The frontend's Tracing (it decides root sampling, at `ratio`; its provider records every root
    it is asked to start), exporting to memory instead of OTLP."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingSettings(None, "http/protobuf", ratio), decides_roots=True, exporter=exporter)
    return tracing, exporter


def exported(tracing: Tracing, exporter: InMemorySpanExporter) -> tuple[ReadableSpan, ...]:
    """Every span finished so far (export runs in a background thread: flush it first)."""
    tracing.force_flush()
    return exporter.get_finished_spans()


def serve(middleware: RequestContextMiddleware, headers: list[tuple[bytes, bytes]],
          path: str = "/v2/models/m/infer") -> None:
    """One request through the middleware, to an app that runs a trace_step."""
    async def app(scope, receive, send):
        with trace_step("custom"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    middleware.app = app
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(middleware(scope, receive, send))


def test_unsampled_requests_and_their_steps_make_no_span():
    tracing, exporter = recording_tracing(ratio=1e-12)
    steps: list[str] = []
    set_step_sink(lambda name, seconds: steps.append(name), tracing.tracer)
    try:
        middleware = RequestContextMiddleware(None, LiveKnobs(0.3, False), tracing=tracing)
        serve(middleware, [])  # no traceparent: the ratio says no
        serve(middleware, [(b"traceparent", UNSAMPLED.encode())])  # the caller says no
        assert exported(tracing, exporter) == ()
        assert steps == ["custom", "custom"]  # the histogram still gets every step

        serve(middleware, [(b"traceparent", SAMPLED.encode())])  # the caller says yes
        spans = {s.name: s for s in exported(tracing, exporter)}
        assert set(spans) == {"http", "custom"}
        assert spans["custom"].parent.span_id == spans["http"].context.span_id
        assert spans["http"].context.trace_id == int(SAMPLED.split("-")[1], 16)
    finally:
        set_step_sink(None)
        tracing.shutdown()


def test_roots_are_recorded_at_the_configured_ratio():
    tracing, exporter = recording_tracing(ratio=1.0)
    try:
        middleware = RequestContextMiddleware(None, LiveKnobs(0.3, False), tracing=tracing)
        for _ in range(3):
            serve(middleware, [])
        assert [s.name for s in exported(tracing, exporter)].count("http") == 3
        for probe in ("/healthz", "/v2/health/ready", "/metrics"):  # probes and scrapes start no trace
            serve(middleware, [], path=probe)
        serve(middleware, [(b"traceparent", SAMPLED.encode())], path="/healthz")  # a caller's trace is followed
        assert [s.name for s in exported(tracing, exporter)].count("http") == 4
    finally:
        tracing.shutdown()



def test_a_reapplied_setting_keeps_the_environments_ratio(monkeypatch):
    """Live settings re-apply the ratio in every ingress and on reload. A config that names none
    must keep OTEL_TRACES_SAMPLER_ARG, not fall back to the default (it once did: an ingress then
    sampled 1 in 100 root requests of a server told to sample 1 in a billion)."""
    from servewell.observability.tracing import DEFAULT_SAMPLE_RATIO, sample_ratio_or_default

    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "1e-9")
    assert sample_ratio_or_default(None) == 1e-9
    assert sample_ratio_or_default(0.5) == 0.5  # the config file wins over the environment
    assert sample_ratio_or_default(0.0) == 0.0
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG")
    assert sample_ratio_or_default(None) == DEFAULT_SAMPLE_RATIO
