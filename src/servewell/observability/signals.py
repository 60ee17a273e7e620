"""Golden signals per model over the last evaluation window (and its rollout's standing verdict), for the
alert webhook.

Reads the metrics registry's cumulative counters and keeps the previous reading, so each
snapshot covers exactly the time since the last one; no I/O, cheap enough for the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from servewell.observability.alerting import SignalSnapshot
from servewell.observability.diagnosis import Diagnosis
from servewell.observability.metrics import ServeMetrics

#: (kind, model, detail): ("bucket", model, le), ("count", model, status class),
#: ("outcome", model, outcome), ("restarts", model, "").
_Key = tuple[str, str, str]


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What the engine tells about one model at evaluation time."""

    name: str
    queue_fill_ratio: float | None
    restarts: int
    memory_headroom_ratio: float | None
    rollback: str | None = None  # why its rollout stands rolled back (`Rollout.alert_reason()`); None: it does not


class SignalTracker:
    """Turns cumulative metrics into per-window golden signals."""

    def __init__(self, metrics: ServeMetrics, facts: Callable[[], Iterable[ModelFacts]],
                 diagnoses: Callable[[], Mapping[str, Diagnosis]] | None = None) -> None:
        self._metrics = metrics
        self._facts = facts
        self._diagnoses = diagnoses  # each model's latest reading (the console feed's), for the alerts' advice
        self._previous: dict[_Key, float] = {}

    def snapshots(self) -> list[SignalSnapshot]:
        """One snapshot per model, covering the time since the previous call. Linear in the series:
        each delta is filed under its model once (scanning every model's series for each model took
        20-27 ms on the event loop with 200 lazy models, every evaluation)."""
        current = self._read()
        per_model: dict[str, _ModelDelta] = {}
        for key, value in current.items():
            kind, name, detail = key
            if kind != "restarts":
                per_model.setdefault(name, _ModelDelta()).add(kind, detail, value - self._previous.get(key, 0.0))
        self._previous = current
        out = []
        empty = _ModelDelta()
        diagnoses = self._diagnoses() if self._diagnoses is not None else {}
        for model in self._facts():
            restarts_key = ("restarts", model.name, "")
            restarts = model.restarts - int(self._previous.get(restarts_key, model.restarts))
            self._previous[restarts_key] = float(model.restarts)
            delta = per_model.get(model.name, empty)
            out.append(SignalSnapshot(
                model=model.name,
                p99_latency_s=_quantile(delta.buckets, 0.99),
                error_ratio=_ratio(delta.counts.get("5xx", 0.0), sum(delta.counts.values())),
                rejected_ratio=_ratio(delta.outcomes.get("rejected", 0.0), sum(delta.outcomes.values())),
                queue_fill_ratio=model.queue_fill_ratio,
                worker_restarts=max(0, restarts),
                memory_headroom_ratio=model.memory_headroom_ratio,
                rollback=model.rollback,
                diagnosis=diagnoses.get(model.name),
            ))
        return out

    def _read(self) -> dict[_Key, float]:
        values: dict[_Key, float] = {k: v for k, v in self._previous.items() if k[0] == "restarts"}
        for family in self._metrics.request_latency.collect():
            for sample in family.samples:
                model = sample.labels.get("model", "")
                if sample.name.endswith("_bucket"):
                    key = ("bucket", model, sample.labels["le"])
                    values[key] = values.get(key, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    key = ("count", model, sample.labels["status_class"])
                    values[key] = values.get(key, 0.0) + sample.value
        for family in self._metrics.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = ("outcome", sample.labels["model"], sample.labels["outcome"])
                    values[key] = values.get(key, 0.0) + sample.value
        return values


class _ModelDelta:
    """One model's increments since the previous reading: latency buckets (upper bound, count),
    answers by status class, requests by outcome."""

    __slots__ = ("buckets", "counts", "outcomes")

    def __init__(self) -> None:
        self.buckets: list[tuple[float, float]] = []
        self.counts: dict[str, float] = {}
        self.outcomes: dict[str, float] = {}

    def add(self, kind: str, detail: str, value: float) -> None:
        if kind == "bucket":
            self.buckets.append((float(detail), value))
        elif kind == "count":
            self.counts[detail] = self.counts.get(detail, 0.0) + value
        elif kind == "outcome":
            self.outcomes[detail] = self.outcomes.get(detail, 0.0) + value


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _quantile(per_bound: list[tuple[float, float]], q: float) -> float | None:
    buckets = sorted(per_bound)
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= target:
            if bound == float("inf"):
                return previous_bound  # beyond the last finite bucket: its bound is the best we know
            # Linear interpolation inside the bucket, as Prometheus's histogram_quantile does.
            share = (target - previous_count) / (count - previous_count) if count > previous_count else 1.0
            return previous_bound + (bound - previous_bound) * share
        previous_bound, previous_count = bound, count
    return None
