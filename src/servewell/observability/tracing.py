"""OpenTelemetry tracing: setup from settings or the standard OTEL_* variables, and helpers.

Spans: `http` (per request, from an incoming W3C `traceparent` when given), `preprocess` and
`queue` (children of `http`), one `batch` span per executed batch that links to every
request span in it, and `compute` inside the worker, a child of `batch` (its context crosses
the process boundary as a `traceparent` string in the batch message).

Export runs in the SDK's background thread with a bounded queue: an unreachable collector
drops spans, it never blocks or fails serving.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("servewell.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()
#: Default share of request traces recorded: 1 in 100 (Triton's default trace rate is 1 in 1000).
#: A traced request costs ~260 us of server CPU (SDK spans in frontend and worker, OTLP encoding):
#: tracing every request runs the tiny MLP at ~0.67x of its throughput with everything off
#: (`python -m bench.observability`), and part of the cost is fixed per export and per batch, so
#: the default stays low: side by side (before the lean OTLP encoder) 5% measured 0.92x and 1%
#: 0.95x; the benchmark's default row now measures 0.99x. A slow request is explained without its
#: trace too: every one logs its stage breakdown. A sampled incoming traceparent is always traced.
DEFAULT_SAMPLE_RATIO = 0.01
#: Longest a process's exit waits for its queued spans to reach the collector. The SDK's own
#: shutdown flushes batch after batch, each up to the export timeout: a collector that accepts
#: connections and never answers held SIGTERM up for 18-19 s (8 batches x 2 s, plus the workers').
SHUTDOWN_FLUSH_S = 1.0


@dataclass(slots=True, frozen=True)
class TracingSettings:
    """Where spans go and how many are kept; picklable, so workers get the same settings."""

    endpoint: str | None
    protocol: str  # "http/protobuf" or "grpc"
    sample_ratio: float
    service_name: str = "servewell"

    @property
    def enabled(self) -> bool:
        """Tracing is on when a collector endpoint is configured and anything is sampled."""
        return bool(self.endpoint) and self.sample_ratio > 0


def settings_from(endpoint: str | None, protocol: str | None, sample_ratio: float | None) -> TracingSettings:
    """Merge explicit settings with the standard OTEL_* environment variables (explicit wins)."""
    env = os.environ
    endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    protocol = protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") \
        or "http/protobuf"
    return TracingSettings(endpoint, protocol, sample_ratio_or_default(sample_ratio),
                           env.get("OTEL_SERVICE_NAME", "servewell"))


def sample_ratio_or_default(sample_ratio: float | None) -> float:
    """The configured ratio, else OTEL_TRACES_SAMPLER_ARG, else the default. Every place that
    (re)applies the setting uses this, so a live reload keeps the environment's ratio."""
    if sample_ratio is not None:
        return sample_ratio
    raw = os.environ.get("OTEL_TRACES_SAMPLER_ARG")
    return float(raw) if raw else DEFAULT_SAMPLE_RATIO


class Tracing:
    """The tracer of this process (a no-op tracer when tracing is off).

    With `decides_roots` (the frontend), the caller decides whether a request that arrives
    without a trace is recorded, by `sample_root()`, before it makes any span: an unsampled
    request then costs one random number instead of the SDK's span machinery (measured at about
    20 us per request). The provider then records every root span it is asked for.
    """

    def __init__(self, settings: TracingSettings, make_global: bool = False, decides_roots: bool = False,
                 exporter: SpanExporter | None = None) -> None:
        """`exporter` replaces the OTLP exporter of `settings` and turns tracing on by itself
        (tests and benchmarks keep spans in memory or only encode them)."""
        self.settings = settings
        self._provider: TracerProvider | None = None
        self._exporter: SpanExporter | None = None
        self.tracer: Tracer = trace.NoOpTracer()
        if settings.enabled or exporter is not None:
            self._exporter = exporter or _otlp_exporter(settings)
            self._provider = _provider(settings, decides_roots, self._exporter)
            self.tracer = self._provider.get_tracer("servewell")
            if make_global:
                # In workers, so model code using OpenTelemetry directly joins the same traces. Not in
                # the frontend: there, libraries that trace through the global provider (FastAPI
                # does) would add spans to every request, measured at over 100 us each.
                trace.set_tracer_provider(self._provider)

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded."""
        return self._provider is not None

    def set_sample_ratio(self, ratio: float) -> None:
        """Record this share of new traces from now on (config reload). Turning tracing on or off
        needs a restart: the exporter is set up at start."""
        self.settings = replace(self.settings, sample_ratio=ratio)

    def sample_root(self) -> bool:
        """Whether to record a request that arrives without a trace (the configured ratio)."""
        return random.random() < self.settings.sample_ratio

    def force_flush(self) -> None:
        """Export every span queued so far, now (tests and benchmarks that read or time the export)."""
        if self._provider is not None:
            self._provider.force_flush()

    def shutdown(self, timeout_s: float = SHUTDOWN_FLUSH_S) -> None:
        """Flush what is queued for at most `timeout_s`, then drop the rest and stop exporting."""
        if self._provider is None:
            return
        exporter = self._exporter
        # Shutting the exporter down makes every later export return at once (and wakes one that
        # waits on a silent collector), so the provider's flush ends soon after the deadline.
        timer = threading.Timer(timeout_s, exporter.shutdown) if exporter is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            self._provider.shutdown()
        finally:
            if timer is not None:
                timer.cancel()


def _provider(settings: TracingSettings, decides_roots: bool, exporter: SpanExporter | None = None) -> TracerProvider:
    """The tracer provider: resource, parent-based sampler, bounded batch export to `exporter`
    (by default the OTLP exporter of `settings`; benchmarks pass their own)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

    from servewell.observability.resource import HashedResource

    exporter = exporter if exporter is not None else _otlp_exporter(settings)
    detected = Resource.create({"service.name": settings.service_name})
    provider = TracerProvider(
        resource=HashedResource(detected.attributes, detected.schema_url),
        sampler=ParentBased(ALWAYS_ON if decides_roots else TraceIdRatioBased(settings.sample_ratio)),
    )
    # A bounded queue: when the collector is slow or gone, spans are dropped, requests are not.
    # The standard OTEL_BSP_* variables override these (tests shorten the delay).
    provider.add_span_processor(BatchSpanProcessor(
        exporter, max_queue_size=_env_int("OTEL_BSP_MAX_QUEUE_SIZE", 4096),
        schedule_delay_millis=_env_int("OTEL_BSP_SCHEDULE_DELAY", 1000),
        max_export_batch_size=_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        export_timeout_millis=_env_int("OTEL_BSP_EXPORT_TIMEOUT", 2000)))
    return provider


def _otlp_exporter(settings: TracingSettings) -> SpanExporter:
    if not settings.endpoint:
        raise ValueError("OTLP export needs an endpoint")
    exporter: SpanExporter
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.endpoint, insecure=True, timeout=2)
    else:
        from servewell.observability.otlp import OtlpHttpSpanExporter

        endpoint = settings.endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        exporter = OtlpHttpSpanExporter.from_environment(endpoint, timeout_s=2.0)
    return exporter


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, raw)
        return default


def extract_context(traceparent: str | None, tracestate: str | None) -> Context | None:
    """Context of an incoming W3C trace, or None."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


def begin_server_span(
    tracing: Tracing, name: str, traceparent: str | None, tracestate: str | None, may_sample_root: bool,
    attributes: dict[str, str],
) -> tuple[Span | None, Context | None]:
    """The span of an incoming request and the context to run it in (both None when not traced).

    Parent-based sampling, decided before any span exists: a sampled incoming trace is recorded;
    an unsampled one is only carried (its trace id reaches the logs); a request without one is
    recorded at the configured ratio, and only when `may_sample_root` (never a probe or scrape)."""
    parent = extract_context(traceparent, tracestate)
    parent_span = trace.get_current_span(parent).get_span_context() if parent is not None else None
    if parent_span is not None and parent_span.is_valid:
        sampled = parent_span.trace_flags.sampled
    else:
        parent, sampled = None, may_sample_root and tracing.sample_root()
    if not sampled:
        return None, parent
    span = tracing.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    return span, trace.set_span_in_context(span)


def traceparent_of(span_context: SpanContext) -> str | None:
    """W3C traceparent string of a span context (None when invalid)."""
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def context_from_traceparent(traceparent: str | None) -> Context | None:
    """A parent context for a span continued in another process."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    if len(parts) != 4:
        return None
    span_context = SpanContext(int(parts[1], 16), int(parts[2], 16), is_remote=True,
                               trace_flags=TraceFlags(int(parts[3], 16)))
    return trace.set_span_in_context(NonRecordingSpan(span_context))


__all__ = [
    "Link", "SpanKind", "Tracing", "TracingSettings", "begin_server_span", "context_from_traceparent",
    "extract_context",
    "settings_from", "traceparent_of",
]
