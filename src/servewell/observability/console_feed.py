"""The console's live charts: a bounded time series per model, sampled from `ServeMetrics` on a timer.

Every `interval_s` the feed reads the cumulative histograms and counters servewell keeps anyway
(so serving does no extra work per request), subtracts the previous reading and keeps one point
per model, plus one for all models together: requests/s by outcome, p50/p99 latency of inference
requests, p50/p99 queue wait and batch compute time, mean batch size and batches/s. Percentiles
come from bucket deltas, interpolated inside a bucket as Prometheus's `histogram_quantile` does,
so they are as fine as the buckets (`--latency-buckets-s`). Points older than `window_s` fall
off, and at most `max_models` models are followed: memory is bounded by
(window / interval) x models points of a few hundred bytes.

The outcome series counts 4xx answers of inference routes as `client_error`: the outcome counter
only sees requests that reached a model's scheduler, so bad input, unknown models and rate
limits were missing from the chart. `summary` gives each model's golden signals over the last
`SUMMARY_WINDOW_S` for the models table (and its p99 split, `latency_reading.py`).

Beside the series: each model's batch compute time by batch size (`compute_by_batch_size`, from
`servewell_batch_compute_by_size_seconds` over the last one to two minutes), the slow and failed
requests the console lists (`RecentRequests`), and the server's own active alerts
(`alerting.ActiveAlerts`).

The feed also holds the server's other views over time, all bounded and all kept in the engine:
the processes' resident memory (`memory`, `memory_series.py`), worker replacements with their gaps
(`worker_events`, `worker_events.py`), the audit trail of changes (`audit`, `audit.py`) and each
model's latest diagnosis (`diagnoses`, `diagnosis.py`), which the hooks set by the server compute
on each tick (`on_tick`) so that the console, `/healthz`, `/metrics` and the alerts read the same
one. Windowed figures for those come from the same readings as the charts: the response cache's
lookups and repeats per model (`cache_between`), refusals by model, lane, tenant and reason
(`refusals_between`) and each tenant's results (`tenants_between`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from servewell.observability.alerting import ActiveAlerts
from servewell.observability.audit import AuditTrail
from servewell.observability.diagnosis import Diagnosis
from servewell.observability.loop_metrics import LoopCounter, LoopHistogram
from servewell.observability.memory_series import MemorySeries, ProcessMemory
from servewell.observability.metrics import OUTCOMES, ServeMetrics
from servewell.observability.recent_requests import RecentRequests
from servewell.observability.view_sources import ViewSources
from servewell.observability.worker_events import WorkerEvents

log = logging.getLogger("servewell.console")

#: Points of every series go under this name as well as under each model's.
ALL_MODELS = "*"
SAMPLE_INTERVAL_S = 2.0
WINDOW_S = 300.0
MAX_MODELS = 64
#: The compute-by-batch-size view counts the batches since a baseline reading taken every this
#: many seconds, the older of the last two: one to two periods of batches, never all since start.
BY_SIZE_PERIOD_S = 60.0
#: The models table's per-model figures cover this many seconds (long enough for a p99 of a few
#: hundred requests at modest traffic, short enough to show a change within a minute).
SUMMARY_WINDOW_S = 30.0
#: The columns of a point, in order (times in milliseconds, rates per second).
#: 4xx answers of inference routes that no model outcome counts (bad input, unknown model, rate
#: limited; the scheduler never saw them): without this column they appeared nowhere in the chart.
CLIENT_ERROR = "client_error"
#: The response cache's lookups per second by result, and the share that were hits (None: no lookup).
CACHE_COLUMNS = ("cache_hit", "cache_coalesced", "cache_miss", "cache_hit_ratio")
COLUMNS = ("t", *OUTCOMES, CLIENT_ERROR, "latency_p50_ms", "latency_p99_ms", "queue_p50_ms", "queue_p99_ms",
           "compute_p50_ms", "compute_p99_ms", "batch_mean", "batches_per_s", *CACHE_COLUMNS)


def is_inference_route(route: str) -> bool:
    """Whether a `route` label of the request histogram is an inference call (the latency chart
    leaves out metadata, health and console requests)."""
    return route.endswith(("/infer", "/predict")) or route == "grpc ModelInfer"


def quantile(bounds: Sequence[float], cumulative: Sequence[float], q: float) -> float | None:
    """The `q`-quantile of a histogram: `bounds` are the finite bucket upper bounds, ascending;
    `cumulative` the count at or below each bound, then the total (+Inf). Linear inside a bucket
    (from the previous bound, 0 for the first); a quantile beyond the last finite bound is that
    bound, the best the buckets know. None when the histogram is empty."""
    if len(cumulative) != len(bounds) + 1:
        raise ValueError("cumulative needs one count per bound plus the +Inf total")
    total = cumulative[-1]
    if total <= 0:
        return None
    target = q * total
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=False):  # the last count (+Inf) has no finite bound
        if count >= target and count > below:
            return lower + (bound - lower) * (target - below) / (count - below)
        lower, below = bound, count
    return lower


def counter_increase(current: float, previous: float | None) -> float:
    """How much a cumulative count rose since `previous`; a count that went down was reset (its
    series started again), so all of `current` is new."""
    if previous is None or current < previous:
        return current
    return current - previous


@dataclass(slots=True)
class HistogramReading:
    """One histogram, summed over every series that counts: cumulative counts at each finite bound
    then +Inf, and the sum of observed values."""

    cumulative: list[float]
    total: float

    @property
    def count(self) -> float:
        """Observations."""
        return self.cumulative[-1] if self.cumulative else 0.0

    def since(self, earlier: HistogramReading | None) -> HistogramReading:
        """What was observed after `earlier` (everything, when the histogram was reset since)."""
        if earlier is None or len(earlier.cumulative) != len(self.cumulative) or self.count < earlier.count:
            return self
        deltas = [a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)]
        return HistogramReading(deltas, self.total - earlier.total)


@dataclass(slots=True)
class MetricsReading:
    """The cumulative values the console charts, per model name and under `ALL_MODELS`."""

    outcomes: dict[str, dict[str, float]] = field(default_factory=dict)
    latency: dict[str, HistogramReading] = field(default_factory=dict)
    queue_wait: dict[str, HistogramReading] = field(default_factory=dict)
    compute: dict[str, HistogramReading] = field(default_factory=dict)
    batch_size: dict[str, HistogramReading] = field(default_factory=dict)
    latency_bounds: tuple[float, ...] = ()
    # For the per-model summary and latency split (console's models table):
    client_errors: dict[str, float] = field(default_factory=dict)  # 4xx answers of inference routes
    preprocess: dict[str, HistogramReading] = field(default_factory=dict)
    postprocess: dict[str, HistogramReading] = field(default_factory=dict)
    # For the cache view, the tenants' view and the diagnosis (cumulative, like the rest):
    cache: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> result -> lookups
    reuses: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> within/beyond -> repeats
    reuse_interval: dict[str, HistogramReading] = field(default_factory=dict)
    reuse_bounds: tuple[float, ...] = ()
    refusals: dict[tuple[str, str, str, str], float] = field(default_factory=dict)  # (model, lane, tenant, reason)
    tenant_results: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> result -> requests


def read_metrics(metrics: ServeMetrics) -> MetricsReading:
    """Read the families the console charts (their series' current values, copied)."""
    reading = MetricsReading()
    model_at, outcome_at = metrics.requests.labelnames.index("model"), metrics.requests.labelnames.index("outcome")
    for values, count in metrics.requests.snapshot():
        for key in _keys(values[model_at]):
            per_outcome = reading.outcomes.setdefault(key, {})
            per_outcome[values[outcome_at]] = per_outcome.get(values[outcome_at], 0.0) + count
    route_at = metrics.request_latency.labelnames.index("route")
    reading.latency_bounds = metrics.request_latency.bounds
    reading.latency = _read_histogram(metrics.request_latency, lambda values: is_inference_route(values[route_at]))
    reading.queue_wait = _read_histogram(metrics.queue_wait)
    reading.compute = _read_histogram(metrics.compute)
    reading.batch_size = _read_histogram(metrics.batch_size)
    reading.preprocess = _read_histogram(metrics.preprocess)
    reading.postprocess = _read_histogram(metrics.postprocess)
    status_at = metrics.request_latency.labelnames.index("status_class")
    model_at = metrics.request_latency.labelnames.index("model")
    for values, per_bucket, _total in metrics.request_latency.snapshot():
        if values[status_at] != "4xx" or not is_inference_route(values[route_at]):
            continue
        # A 4xx naming no model of this server still counts among all models.
        for key in _keys(values[model_at]) or (ALL_MODELS,):
            reading.client_errors[key] = reading.client_errors.get(key, 0.0) + float(sum(per_bucket))
    reading.cache = _by_model(metrics.cache_requests)
    reading.reuses = _by_model(metrics.cache_reuses)
    reading.reuse_interval = _read_histogram(metrics.cache_reuse_interval)
    reading.reuse_bounds = metrics.cache_reuse_interval.bounds
    reading.refusals = {(m, lane, tenant, reason): count
                        for (m, lane, tenant, reason), count in metrics.refusals.snapshot()}
    for (tenant, result), count in metrics.tenant_requests.snapshot():
        per_result = reading.tenant_results.setdefault(tenant, {})
        per_result[result] = per_result.get(result, 0.0) + count
    return reading


def _by_model(family: LoopCounter) -> dict[str, dict[str, float]]:
    """A counter labelled (model, X) as model -> X -> count, all models summed under `ALL_MODELS`."""
    found: dict[str, dict[str, float]] = {}
    for (model, detail), count in family.snapshot():
        for key in _keys(model):
            per = found.setdefault(key, {})
            per[detail] = per.get(detail, 0.0) + count
    return found


def _keys(model: str) -> tuple[str, ...]:
    # "-" and "" mark requests that named no model of this server: they count nowhere.
    return (model, ALL_MODELS) if model and model not in ("-", ALL_MODELS) else ()


def _read_histogram(family: LoopHistogram, counts: Callable[[tuple[str, ...]], bool] | None = None,
                    ) -> dict[str, HistogramReading]:
    model_at = family.labelnames.index("model")
    buckets: dict[str, list[float]] = {}
    sums: dict[str, float] = {}
    for values, per_bucket, total in family.snapshot():
        if counts is not None and not counts(values):
            continue
        for key in _keys(values[model_at]):
            summed = buckets.get(key)
            if summed is None:
                buckets[key] = [float(c) for c in per_bucket]
            else:
                for i, count in enumerate(per_bucket):
                    summed[i] += count
            sums[key] = sums.get(key, 0.0) + total
    return {key: HistogramReading(list(accumulate(summed)), sums[key]) for key, summed in buckets.items()}


def _read_by_size(metrics: ServeMetrics, model: str | None = None) -> dict[tuple[str, str], HistogramReading]:
    """`servewell_batch_compute_by_size_seconds` by (model, batch size label), of one model or all."""
    readings = {}
    for (name, size), per_bucket, total in metrics.compute_by_size.snapshot():
        if model is None or name == model:
            readings[(name, size)] = HistogramReading(list(accumulate(per_bucket)), total)
    return readings


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def point_between(before: MetricsReading, after: MetricsReading, model: str, elapsed_s: float,
                  at: float) -> tuple[float | None, ...]:
    """One point (`COLUMNS`) for `model` over the `elapsed_s` seconds between two readings."""
    outcomes_now = after.outcomes.get(model, {})
    outcomes_then = before.outcomes.get(model, {})
    rates = [round(counter_increase(outcomes_now.get(o, 0.0), outcomes_then.get(o)) / elapsed_s, 3) for o in OUTCOMES]
    rates.append(round(_client_errors(before, after, model) / elapsed_s, 3))
    bounds = after.latency_bounds

    def window(now: dict[str, HistogramReading], then: dict[str, HistogramReading]) -> HistogramReading | None:
        current = now.get(model)
        return current.since(then.get(model)) if current is not None else None

    def percentiles(now: dict[str, HistogramReading], then: dict[str, HistogramReading]) -> list[float | None]:
        delta = window(now, then)
        if delta is None or delta.count <= 0 or len(delta.cumulative) != len(bounds) + 1:
            return [None, None]
        return [_ms(quantile(bounds, delta.cumulative, 0.5)), _ms(quantile(bounds, delta.cumulative, 0.99))]

    batches = window(after.batch_size, before.batch_size)
    batch_mean = round(batches.total / batches.count, 3) if batches is not None and batches.count > 0 else None
    batch_rate = round(batches.count / elapsed_s, 3) if batches is not None else 0.0
    lookups = _increase(after.cache.get(model, {}), before.cache.get(model, {}))
    cache_rates = [round(lookups.get(r, 0.0) / elapsed_s, 3) for r in ("hit", "coalesced", "miss")]
    total = sum(lookups.values())
    hit_ratio = round(lookups.get("hit", 0.0) / total, 4) if total > 0 else None
    return (round(at, 3), *rates, *percentiles(after.latency, before.latency),
            *percentiles(after.queue_wait, before.queue_wait), *percentiles(after.compute, before.compute),
            batch_mean, batch_rate, *cache_rates, hit_ratio)


def _increase(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
    """Per key, how much a cumulative count rose between two readings."""
    return {key: counter_increase(value, then.get(key)) for key, value in now.items()}


def cache_between(before: MetricsReading, after: MetricsReading, model: str) -> dict[str, Any]:
    """`model`'s response cache between two readings: lookups by result (hit, coalesced, miss), repeated
    inputs within and beyond the TTL, and the reuse intervals seen (`reuse_histogram`: count per
    bucket upper bound in seconds, "+Inf" last; `reuse_p50_s`)."""
    lookups = _increase(after.cache.get(model, {}), before.cache.get(model, {}))
    reuses = _increase(after.reuses.get(model, {}), before.reuses.get(model, {}))
    current = after.reuse_interval.get(model)
    delta = current.since(before.reuse_interval.get(model)) if current is not None else None
    histogram: list[dict[str, Any]] = []
    p50 = None
    bounds = after.reuse_bounds
    if delta is not None and len(delta.cumulative) == len(bounds) + 1:
        below = 0.0
        for bound, cumulative in zip((*bounds, float("inf")), delta.cumulative, strict=True):
            histogram.append({"le": "+Inf" if bound == float("inf") else bound, "count": round(cumulative - below)})
            below = cumulative
        p50 = quantile(bounds, delta.cumulative, 0.5)
    return {"hit": lookups.get("hit", 0.0), "coalesced": lookups.get("coalesced", 0.0),
            "miss": lookups.get("miss", 0.0), "reused_within_ttl": reuses.get("within", 0.0),
            "reused_beyond_ttl": reuses.get("beyond", 0.0), "reuse_histogram": histogram,
            "reuse_p50_s": None if p50 is None else round(p50, 3)}


def refusals_between(before: MetricsReading, after: MetricsReading,
                     model: str | None = None) -> dict[tuple[str, str, str, str], float]:
    """Refusals between two readings by (model, lane, tenant, reason), of `model` only when given;
    only those that rose."""
    found = {}
    for key, count in after.refusals.items():
        if model is not None and key[0] != model:
            continue
        rose = counter_increase(count, before.refusals.get(key))
        if rose > 0:
            found[key] = rose
    return found


def tenants_between(before: MetricsReading, after: MetricsReading) -> dict[str, dict[str, float]]:
    """Per tenant label, requests by result between two readings (admitted, the quotas, failed) and
    `refused` (any 429/503 but a quota's, from the refusals by tenant)."""
    found: dict[str, dict[str, float]] = {}
    for tenant, results in after.tenant_results.items():
        found[tenant] = _increase(results, before.tenant_results.get(tenant, {}))
    for (_, _, tenant, reason), count in refusals_between(before, after).items():
        if reason != "over_quota":
            per = found.setdefault(tenant, {})
            per["refused"] = per.get("refused", 0.0) + count
    return found


def _client_errors(before: MetricsReading, after: MetricsReading, model: str) -> float:
    # Cancelled requests are answered 499 (4xx) and already counted as a model outcome.
    fours = counter_increase(after.client_errors.get(model, 0.0), before.client_errors.get(model))
    cancelled = counter_increase(after.outcomes.get(model, {}).get("cancelled", 0.0),
                                 before.outcomes.get(model, {}).get("cancelled"))
    return max(0.0, fours - cancelled)


def summary_between(before: MetricsReading, after: MetricsReading, model: str, elapsed_s: float) -> dict[str, Any]:
    """`model`'s golden signals over the `elapsed_s` seconds between two readings, for the models
    table: answers/s, the share that failed (any outcome but success and cancelled, 4xx included),
    p50/p99 latency of inference requests, and the p99 of each stage (queue wait and preprocess
    per request, compute per batch) with the mean batch size, for the latency split."""
    point = dict(zip(COLUMNS, point_between(before, after, model, elapsed_s, 0.0), strict=True))
    answered = sum(point[o] or 0.0 for o in (*OUTCOMES, CLIENT_ERROR) if o != "cancelled")
    failed = answered - (point["success"] or 0.0)
    bounds = after.latency_bounds

    def p99(now: dict[str, HistogramReading], then: dict[str, HistogramReading]) -> float | None:
        current = now.get(model)
        delta = current.since(then.get(model)) if current is not None else None
        if delta is None or delta.count <= 0 or len(delta.cumulative) != len(bounds) + 1:
            return None
        return _ms(quantile(bounds, delta.cumulative, 0.99))

    return {
        "window_s": round(elapsed_s, 3),
        "requests_per_s": round(answered + (point["cancelled"] or 0.0), 3),
        "error_ratio": round(failed / answered, 4) if answered > 0 else None,
        "latency_p50_ms": point["latency_p50_ms"], "latency_p99_ms": point["latency_p99_ms"],
        "queue_p50_ms": point["queue_p50_ms"], "queue_p99_ms": point["queue_p99_ms"],
        "compute_p50_ms": point["compute_p50_ms"], "compute_p99_ms": point["compute_p99_ms"],
        "preprocess_p99_ms": p99(after.preprocess, before.preprocess),
        "postprocess_p99_ms": p99(after.postprocess, before.postprocess),
        "batch_mean": point["batch_mean"],
    }


class ConsoleFeed:
    """What the console shows over time: per-model series sampled every `interval_s` (while `run`
    runs on the event loop) and the ring of recent slow and failed requests."""

    def __init__(self, metrics: ServeMetrics | None = None, interval_s: float = SAMPLE_INTERVAL_S,
                 window_s: float = WINDOW_S, max_models: int = MAX_MODELS, recent: RecentRequests | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError("need 0 < interval_s <= window_s")
        self.metrics = metrics
        self.interval_s = interval_s
        self.window_s = window_s
        self.recent = recent if recent is not None else RecentRequests()
        self._max_models = max_models
        self._points_kept = int(window_s // interval_s)
        self._clock = clock
        self._wall_clock = wall_clock
        self._series: dict[str, deque[tuple[float | None, ...]]] = {}
        # (taken at, {(model, batch size label): reading}); the first is the view's baseline.
        self._by_size_baselines: deque[tuple[float, dict[tuple[str, str], HistogramReading]]] = deque(maxlen=2)
        self.started_at = wall_clock()
        # The readings of the last `SUMMARY_WINDOW_S` (the models table's summaries); the newest is
        # the one the next point is taken against.
        self._history: deque[tuple[float, MetricsReading]] = deque(
            maxlen=max(2, int(min(SUMMARY_WINDOW_S, window_s) // interval_s) + 1))
        self.alerts = ActiveAlerts()  # kept by the alert evaluation (`run_alerting`), shown by the console
        self.audit = AuditTrail()  # every change (observability/audit.py), shown as the console's timeline
        self.worker_events = WorkerEvents()  # worker replacements with their gaps (observability/worker_events.py)
        self.memory = MemorySeries(interval_s, window_s)  # the processes' resident memory over time
        #: The processes' memory now (set by the server: the engine, its ingress processes, the workers).
        self.memory_source: Callable[[], Sequence[ProcessMemory]] | None = None
        #: Run after each tick's reading (the server's diagnosis of every model, its rollout watch).
        self.on_tick: list[Callable[[], None]] = []
        #: Each model's latest diagnosis (observability/diagnosis.py), set by the tick's hook.
        self.diagnoses: dict[str, Diagnosis] = {}
        #: What ingress processes recorded, absorbed into `metrics` and `recent` (`view_sources.py`);
        #: every read path awaits `view.refresh()` first.
        self.view = ViewSources(metrics, self.recent)

    def sample(self) -> None:
        """Take one reading; from the second on, append a point per model seen so far. Then the
        processes' memory, then the tick's hooks (each failure logged, never raised)."""
        self._sample_metrics()
        if self.memory_source is not None:
            try:
                self.memory.sample(self._wall_clock(), self.memory_source())
            except Exception:  # the console must never take the server down
                log.exception("memory sample failed")
        for hook in self.on_tick:
            try:
                hook()
            except Exception:
                log.exception("console tick hook failed")

    def _sample_metrics(self) -> None:
        if self.metrics is None:
            return
        now, reading = self._clock(), read_metrics(self.metrics)
        previous = self._history[-1] if self._history else None
        if not self._by_size_baselines or now - self._by_size_baselines[-1][0] >= BY_SIZE_PERIOD_S:
            self._by_size_baselines.append((now, _read_by_size(self.metrics)))
        self._history.append((now, reading))
        if previous is None or now <= previous[0]:
            return
        at, elapsed_s = self._wall_clock(), now - previous[0]
        models = set(reading.outcomes) | set(reading.latency) | set(reading.batch_size) | set(reading.cache)
        for model in sorted(models, key=lambda m: (m != ALL_MODELS, m)):  # all-models first: never crowded out
            points = self._series.get(model)
            if points is None:
                if len(self._series) > self._max_models:
                    continue
                points = self._series[model] = deque(maxlen=self._points_kept)
            points.append(point_between(previous[1], reading, model, elapsed_s, at))

    async def run(self) -> None:
        """Sample every `interval_s` until cancelled; a failed sample is logged and skipped."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.view.refresh()
                self.sample()
            except Exception:  # the console must never take the server down
                log.exception("console sample failed")
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    def compute_by_batch_size(self, model: str) -> list[dict[str, Any]]:
        """`model`'s batch compute time by batch size (the metric's power-of-two label) over the
        last one to two minutes: `[{"batch_size", "count", "p50_ms", "p99_ms"}, ...]`, smallest
        first, only sizes that ran. Read now from the histogram (on the event loop, per call)."""
        if self.metrics is None:
            return []
        baseline = self._by_size_baselines[0][1] if self._by_size_baselines else {}
        bounds = self.metrics.compute_by_size.bounds
        rows = []
        for (name, size), current in _read_by_size(self.metrics, model).items():
            window = current.since(baseline.get((name, size)))
            if window.count <= 0 or not size.isdigit():
                continue
            rows.append({"batch_size": int(size), "count": int(window.count),
                         "p50_ms": _ms(quantile(bounds, window.cumulative, 0.5)),
                         "p99_ms": _ms(quantile(bounds, window.cumulative, 0.99))})
        return sorted(rows, key=lambda row: row["batch_size"])

    def models(self) -> list[str]:
        """Names with a series (`ALL_MODELS` first once anything was sampled)."""
        return sorted(self._series, key=lambda m: (m != ALL_MODELS, m))

    def series(self, model: str = ALL_MODELS) -> dict[str, Any]:
        """The model's points as columns (`COLUMNS`: each a list, oldest first; None where the
        interval saw nothing to measure), ready for a chart."""
        points = list(self._series.get(model, ()))
        columns: dict[str, Any] = {name: [p[i] for p in points] for i, name in enumerate(COLUMNS)}
        return {"model": model, "interval_s": self.interval_s, "window_s": self.window_s,
                "enabled": self.metrics is not None, "columns": columns}

    def summary(self, model: str) -> dict[str, Any] | None:
        """`model`'s `summary_between` over the readings of the last `SUMMARY_WINDOW_S` (None until
        two readings exist)."""
        window = self.window()
        if window is None:
            return None
        elapsed_s, before, after = window
        return summary_between(before, after, model, elapsed_s)

    def window(self) -> tuple[float, MetricsReading, MetricsReading] | None:
        """(seconds, the oldest reading, the newest) of the last `SUMMARY_WINDOW_S`; None until two
        readings exist."""
        if len(self._history) < 2:
            return None
        (then, before), (now, after) = self._history[0], self._history[-1]
        return (now - then, before, after) if now > then else None
