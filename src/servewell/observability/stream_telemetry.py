"""What a generative model's steps and parts are measured by (engine/sequences.py calls it):
time to first output and time between outputs per model, outputs (parts) counted, sequences per
step. The figures land in the server's one metrics registry (observability/metrics.py)."""

from __future__ import annotations

from servewell.observability.metrics import ServeMetrics


class StreamTelemetry:
    """Records into `ServeMetrics`' stream families (on the event loop; lock-free counters)."""

    __slots__ = ("_metrics",)

    def __init__(self, metrics: ServeMetrics) -> None:
        self._metrics = metrics

    def first_output(self, model: str, seconds: float) -> None:
        """A stream's first part, `seconds` after its request arrived."""
        self._metrics.time_to_first_output.labels(model).observe(seconds)
        self._metrics.stream_outputs.labels(model).inc()

    def between_outputs(self, model: str, seconds: float) -> None:
        """A later part, `seconds` after the previous one of the same stream."""
        self._metrics.time_between_outputs.labels(model).observe(seconds)
        self._metrics.stream_outputs.labels(model).inc()

    def step(self, model: str, running: int, compute_s: float) -> None:
        """One step ran `running` sequences."""
        self._metrics.sequences_per_step.labels(model).observe(running)

    def ended(self, model: str, reason: str) -> None:
        """A sequence ended (finished, cancelled, deadline_exceeded, stream_too_slow, failed)."""
        self._metrics.sequences_ended.labels(model, reason).inc()


def stream_telemetry(metrics: ServeMetrics | None) -> StreamTelemetry | None:
    """The telemetry for a server's metrics (None without metrics: nothing is measured)."""
    return StreamTelemetry(metrics) if metrics is not None else None
