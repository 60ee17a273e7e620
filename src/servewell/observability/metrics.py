"""Prometheus metrics of servewell: one registry per server, names documented in the README.

Histograms and counters are updated on the hot path (per request or per batch); gauges that
describe state (queue depth, model state, worker processes, GPUs) are read at scrape time by
`StateCollector`, so serving never maintains them. Labels are low-cardinality: model, lane,
route, status class, outcome, instance, gpu.

Histograms and counters here are servewell's own lock-free ones (`observability/loop_metrics.py`),
exposed through prometheus-client's registry and text format.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import GCCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servewell.observability.diagnosis import Diagnosis
from servewell.observability.exposition import OrderedRegistry
from servewell.observability.loop_metrics import LoopCounter, LoopHistogram
from servewell.observability.metrics_merge import (
    AbsorbedMetrics,
    CounterData,
    FamilyShape,
    HistogramData,
    MetricsSnapshot,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Cold starts run from a tenth of a second (a tiny model, spare worker) to minutes (a large one).
COLD_START_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
#: Time between a stream's parts: a step of a small model is a fraction of a millisecond.
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
OUTCOMES = ("success", "rejected", "deadline_exceeded", "cancelled", "error")
#: How long callers take to ask for the same inputs again, against a response cache's TTL.
REUSE_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def batch_size_bucket(rows: int) -> int:
    """The `batch_size` label of a batch of `rows`: the next power of two at or above it (1, 2, 4,
    ...), so a model whose largest batch is N has at most log2(N) + 1 series."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass(slots=True, frozen=True)
class WorkerSample:
    """One worker process at scrape time."""

    model: str
    instance: int
    up: bool
    pid: int | None


@dataclass(slots=True, frozen=True)
class ModelSample:
    """One model's state at scrape time."""

    name: str
    state: str
    lane_depths: dict[str, int]
    inflight: int
    effective_max_batch_size: int
    workers: tuple[WorkerSample, ...] = field(default_factory=tuple)
    # The model pool (engine/model_pool.py), filled in by the engine from the model's slot.
    residency: str = "resident"  # resident, loading, evicted, not_loaded, failed, invalid
    pinned: bool = False
    last_used_at: float | None = None  # wall clock of the model's last request (None: never used)
    estimated_bytes: int | None = None  # host memory its instances are estimated to need
    cache_bytes: int | None = None  # its response cache's kept answers (None: no cache)
    cache_entries: int = 0


MODEL_STATES = ("loading", "ready", "restarting", "failed", "invalid", "unloaded")
#: `servewell_model_pool_models{residency}`: every value is exported (0 too), so a query never
#: finds a series missing.
RESIDENCIES = ("resident", "loading", "evicted", "not_loaded", "failed", "invalid")


class ServeMetrics:
    """All metric families of one server, in their own registry."""

    def __init__(self, latency_buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.registry = OrderedRegistry()  # written by `exposition.render_text` in slices
        r = self.registry
        # The frontend process itself: CPU (its event loop is what saturates first on small
        # models), memory, and the garbage collector's collections by generation.
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self.request_latency = LoopHistogram(
            "servewell_request_duration_seconds", "Time from request arrival to response, by route and status class.",
            ["model", "route", "status_class"], buckets=latency_buckets, registry=r)
        self.queue_wait = LoopHistogram(
            "servewell_queue_wait_seconds", "Time a request waited in its lane before its batch started.",
            ["model", "lane"], buckets=latency_buckets, registry=r)
        self.preprocess = LoopHistogram(
            "servewell_preprocess_seconds", "Decoding and preprocessing per request (JSON tensors, images).",
            ["model"], buckets=latency_buckets, registry=r)
        self.compute = LoopHistogram(
            "servewell_batch_compute_seconds", "Model compute per batch, measured inside the worker.",
            ["model"], buckets=latency_buckets, registry=r)
        # Compute by batch size: whether compute grows with the batch (an on-call engineer had to
        # probe with their own requests to learn it). Beside `servewell_batch_compute_seconds`
        # rather than a new label on it, so existing queries and dashboards keep their meaning.
        self.compute_by_size = LoopHistogram(
            "servewell_batch_compute_by_size_seconds", "Model compute per batch by batch size (rows, rounded "
            "up to a power of two: 1, 2, 4, ...).", ["model", "batch_size"], buckets=latency_buckets, registry=r)
        self.transport = LoopHistogram(
            "servewell_batch_transport_seconds", "Per-batch cost of the process hop (round trip minus compute).",
            ["model"], buckets=latency_buckets, registry=r)
        self.postprocess = LoopHistogram(
            "servewell_postprocess_seconds", "Response encoding per request.",
            ["model"], buckets=latency_buckets, registry=r)
        self.batch_size = LoopHistogram(
            "servewell_batch_size", "Rows per executed batch.", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.requests = LoopCounter(
            "servewell_requests", "Inference requests by outcome and lane.", ["model", "lane", "outcome"], registry=r)
        self.model_loads = LoopCounter(
            "servewell_model_loads", "Model load attempts by result.", ["model", "result"], registry=r)
        self.model_evictions = LoopCounter(
            "servewell_model_evictions", "Models unloaded to free memory, by reason (memory: to make room for a "
            "load; idle: idle_unload_s passed; operator: POST /admin/models/{name}/evict).", ["model", "reason"],
            registry=r)
        self.cold_start = LoopHistogram(
            "servewell_model_cold_start_seconds", "Lazy mode: from a request finding its model not resident until "
            "the model was ready (queueing for a load slot, eviction, spawn, load and warm-up).", ["model"],
            buckets=COLD_START_BUCKETS, registry=r)
        self.pool_requests = LoopCounter(
            "servewell_model_pool_requests", "Lazy mode: inference requests by whether their model was resident "
            "(hit) or had to be loaded first (miss).", ["result"], registry=r)
        self.cache_requests = LoopCounter(
            "servewell_response_cache_requests", "Requests to a model with a response cache, by result (hit: "
            "answered from the cache; coalesced: shared an identical request's computation; miss: computed).",
            ["model", "result"], registry=r)
        self.cache_evictions = LoopCounter(
            "servewell_response_cache_evictions", "Cached answers dropped, by reason (size: max_bytes; ttl: older "
            "than ttl_s).", ["model", "reason"], registry=r)
        self.cache_reuse_interval = LoopHistogram(
            "servewell_response_cache_reuse_interval_seconds", "Time between two requests for the same inputs of a "
            "model with a response cache (a hit, or a miss for inputs whose answer was kept before): set "
            "cache.ttl_s above it, or the answers expire before they are asked for again.", ["model"],
            buckets=REUSE_BUCKETS, registry=r)
        self.cache_reuses = LoopCounter(
            "servewell_response_cache_reuses", "Requests for inputs asked for before, by whether they came within the "
            "cache's ttl_s (vs_ttl=within: could be a hit) or after it (beyond: the answer had expired).",
            ["model", "vs_ttl"], registry=r)
        self.tenant_requests = LoopCounter(
            "servewell_tenant_requests", "Inference requests per tenant (the keys file's tenants; '-': no key) by "
            "result: admitted; refused over a quota (over_rate, over_concurrency, over_queue); refused (any 429 or 503 "
            "after admission, e.g. pushed out of a full lane) or failed (any other error).",
            ["tenant", "result"], registry=r)
        self.refusals = LoopCounter(
            "servewell_refusals", "Inference requests refused (429, 503) by model, lane, tenant (the keys file's; '-': "
            "no key) and reason (the error code: overloaded, over_quota, deadline_exceeded, model_loading, ...), "
            "whichever stage refused them, a request pushed out of a full lane included.",
            ["model", "lane", "tenant", "reason"], registry=r)
        self.tenant_duration = LoopHistogram(
            "servewell_tenant_request_duration_seconds", "Per tenant: from the engine admitting a request to its "
            "answer (queue, batch, compute; cached answers too).", ["tenant"], buckets=latency_buckets, registry=r)
        self.pipeline_steps = LoopCounter(
            "servewell_pipeline_steps", "Steps of pipeline requests, by pipeline, step and outcome (success, "
            "skipped by its condition, or the error code that ended the request there).",
            ["pipeline", "step", "outcome"], registry=r)
        self.pipeline_step_duration = LoopHistogram(
            "servewell_pipeline_step_duration_seconds", "Per pipeline step: from the step's start (its inputs ready) "
            "to its outputs (queue, batch and compute in the step model).", ["pipeline", "step"],
            buckets=latency_buckets, registry=r)
        self.worker_restarts = LoopCounter(
            "servewell_worker_restarts", "Worker processes replaced, by reason (crash: died; hung: no heartbeat "
            "or a batch over its compute budget, killed; memory: over host_memory_limit_bytes, drained): every "
            "replacement, counted as /healthz counts `restarts` (`restarts_by_reason`).",
            ["model", "reason"], registry=r)
        self.api_key_requests = LoopCounter(
            "servewell_api_key_requests", "Requests that presented a valid API key, by key id and result "
            "(allowed; a key's rate is its tenant's quota: servewell_tenant_requests_total).", ["key", "result"],
            registry=r)
        self.auth_failures = LoopCounter(
            "servewell_auth_failures", "Requests refused for a missing or invalid API key.", ["reason"], registry=r)
        self.trace_steps = LoopHistogram(
            "servewell_trace_step_seconds", "Durations of trace_step() blocks in model code.",
            ["step"], buckets=latency_buckets, registry=r)
        self.fast_path_requests = LoopCounter(
            "servewell_http_fast_path_requests", "HTTP inference requests dispatched straight to their endpoint, "
            "without FastAPI's routing (by route template; the rest of the API goes through FastAPI).",
            ["route"], registry=r)
        self.rollout_requests = LoopCounter(
            "servewell_rollout_requests", "Answers of a model with a traffic split or a shadow, by version and "
            "outcome (error: the version's own failure: model error, worker lost or hung, deadline).",
            ["model", "version", "outcome"], registry=r)
        self.rollout_events = LoopCounter(
            "servewell_rollout_events", "Automatic rollbacks and promotions of a model's versions, by the rule "
            "that decided (error_rate, p99, shadow_agreement, promote).", ["model", "version", "action", "rule"],
            registry=r)
        self.shadow_requests = LoopCounter(
            "servewell_shadow_requests", "Copies of requests for a shadow version: compared with the primary's "
            "answer, shed (no spare capacity) or failed.", ["model", "version", "outcome"], registry=r)
        self.shadow_rows = LoopCounter(
            "servewell_shadow_rows", "Rows whose top-1 was compared between the primary and the shadow, per output.",
            ["model", "version", "output"], registry=r)
        self.shadow_top1_matches = LoopCounter(
            "servewell_shadow_top1_matches", "Compared rows whose top-1 (argmax) agrees between the primary and the "
            "shadow, per output.", ["model", "version", "output"], registry=r)
        self.shadow_max_abs_diff = LoopHistogram(
            "servewell_shadow_max_abs_diff", "Per compared request and output: the largest absolute difference "
            "between the primary's and the shadow's values.", ["model", "version", "output"],
            buckets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0), registry=r)
        self.shadow_latency = LoopHistogram(
            "servewell_shadow_latency_seconds", "Per shadow copy: from its submission to its answer (its queue, "
            "batch and compute on spare capacity).", ["model", "version", "role"], buckets=latency_buckets,
            registry=r)
        # Generative models (engine/sequences.py): each part of a stream as it is made.
        self.time_to_first_output = LoopHistogram(
            "servewell_time_to_first_output_seconds", "Per stream of a generative model: from the request's arrival "
            "to its first part.", ["model"], buckets=latency_buckets, registry=r)
        self.time_between_outputs = LoopHistogram(
            "servewell_time_between_outputs_seconds", "Per part after the first of a generative model's stream: the "
            "time since its previous part.", ["model"], buckets=STEP_BUCKETS, registry=r)
        self.stream_outputs = LoopCounter(
            "servewell_stream_outputs", "Parts made by a generative model's sequences (rate(): outputs per second).",
            ["model"], registry=r)
        self.sequences_ended = LoopCounter(
            "servewell_sequences_ended", "Sequences of a generative model that ended, by why: finished, cancelled "
            "(the client went away), deadline_exceeded, stream_too_slow, failed.", ["model", "reason"], registry=r)
        self.sequences_per_step = LoopHistogram(
            "servewell_sequences_per_step", "Sequences each step of a generative model ran (continuous batching's "
            "batch size).", ["model"], buckets=BATCH_BUCKETS, registry=r)
        #: Unique per object: snapshots of a restarted process are told apart from the old one's.
        self.incarnation = uuid.uuid4().hex
        self._sequence = itertools.count(1)
        self._absorbed = AbsorbedMetrics({f.name: FamilyShape(f.labelnames, f.bounds if isinstance(f, LoopHistogram)
                                                              else None) for f in self.families()})
        for family in self.families():
            family.sum_with(self._absorbed)

    def families(self) -> list[LoopHistogram | LoopCounter]:
        """servewell's own histogram and counter families (not the process_/python_ collectors, not
        the gauges read at scrape time)."""
        return [v for v in vars(self).values() if isinstance(v, LoopHistogram | LoopCounter)]

    def snapshot(self) -> MetricsSnapshot:
        """This process's own series of every family, cumulative since this object was made (never
        what it absorbed), as plain picklable data: what an ingress process hands the engine
        (0.13 ms for 147 series; figures in `observability/view_sources.py`)."""
        histograms, counters = {}, {}
        for family in self.families():
            if isinstance(family, LoopHistogram):
                histograms[family.name] = HistogramData(
                    family.labelnames, family.bounds, {v: (c, t) for v, c, t in family.own_snapshot()})
            else:
                counters[family.name] = CounterData(family.labelnames, dict(family.own_snapshot()))
        return MetricsSnapshot(self.incarnation, next(self._sequence), histograms, counters)

    def absorb(self, source: str, snapshot: MetricsSnapshot) -> bool:
        """Keep `snapshot` (another process's `snapshot()`) as `source`'s latest: from now on every
        reader of every family sees this process's series plus the latest of each source plus every
        retired one (`observability/metrics_merge.py` for the rules). False when it was dropped as
        stale or as a retired incarnation's."""
        return self._absorbed.absorb(source, snapshot)

    def retire(self, source: str) -> bool:
        """`source` is gone: what it counted stays in every sum for good (counters never go down);
        False when nothing of it was kept."""
        return self._absorbed.retire(source)

    def sources(self) -> list[str]:
        """The live sources absorbed, by name."""
        return self._absorbed.sources()

    def observe_request(self, model: str, route: str, status: int, seconds: float) -> None:
        """Record one finished HTTP request (any status)."""
        self.request_latency.labels(model or "-", route, f"{status // 100}xx").observe(seconds)

    def count(self, model: str, lane: str, outcome: str) -> None:
        """Count one inference request by outcome."""
        self.requests.labels(model, lane, outcome).inc()

    def count_refusal(self, model: str, lane: str, tenant: str, reason: str) -> None:
        """Count one refused request (`tenant` "": requests without a key)."""
        self.refusals.labels(model, lane, tenant or "-", reason).inc()


ProcessReader = Callable[[int], dict[str, float]]


class StateCollector(Collector):
    """Gauges read at scrape time: queues, states, workers (from /proc), GPUs (NVML)."""

    def __init__(
        self,
        models: Callable[[], Iterable[ModelSample]],
        read_process: ProcessReader,
        gpus: Callable[[], list[dict[str, float]]] | None = None,
        budget: Callable[[], tuple[int, int]] | None = None,
        ready: Callable[[], bool] | None = None,
        device_budget: Callable[[], tuple[int | None, int]] | None = None,
    ) -> None:
        self._models = models
        self._read_process = read_process
        self._gpus = gpus
        self._budget = budget
        self._ready = ready
        self._device_budget = device_budget  # (total or None: not limited, reserved) bytes

    def collect(self) -> Iterable[Metric]:
        models = list(self._models())
        facts = _read_every(self._read_process, _live_pids(models))
        yield from (metric for metric in self._families(models, facts) if metric is not None)

    async def collect_off_loop(self) -> Iterator[Metric | None]:
        """`collect` for a scrape on the event loop: the workers' /proc reads run on a thread, and
        the families come with a `None` after each model's series (a point where the caller may
        hand the loop back). A read costs 0.6-2.4 ms a worker (smaps_rollup walks the process's
        page tables, so more for a bigger model); 200 resident models' reads in one go held the
        loop about 200 ms. The models are read once, on the loop: one moment's state."""
        models = list(self._models())
        facts = await asyncio.to_thread(_read_every, self._read_process, _live_pids(models))
        return self._families(models, facts)

    def _families(self, models: list[ModelSample], facts: dict[int, dict[str, float]]) -> Iterator[Metric | None]:
        """Every family, with a `None` after each model's series are added (see `collect_off_loop`)."""
        depth = GaugeMetricFamily("servewell_queue_depth", "Requests waiting, per lane.", labels=["model", "lane"])
        inflight = GaugeMetricFamily("servewell_inflight_requests", "Requests admitted and not yet answered.",
                                     labels=["model"])
        state = GaugeMetricFamily("servewell_model_state", "1 for the model's current state.",
                                  labels=["model", "state"])
        up = GaugeMetricFamily("servewell_worker_up", "1 when the worker process is alive.", labels=["model", "worker"])
        max_batch = GaugeMetricFamily("servewell_effective_max_batch_size", "Largest batch the scheduler forms now.",
                                      labels=["model"])
        rss = GaugeMetricFamily("servewell_worker_resident_memory_bytes", "Worker RSS.", labels=["model", "worker"])
        private = GaugeMetricFamily("servewell_worker_private_memory_bytes", "Worker private (anonymous) memory: "
                                    "converted weights, activations, the interpreter; not memory-mapped files.",
                                    labels=["model", "worker"])
        mapped = GaugeMetricFamily("servewell_worker_mapped_file_memory_bytes", "Worker resident memory backed by "
                                   "files: memory-mapped weights served as stored (fp32 from fp32 safetensors), "
                                   "libraries.", labels=["model", "worker"])
        cpu = GaugeMetricFamily("servewell_worker_cpu_seconds", "Worker CPU time (user + system) since it started.",
                                labels=["model", "worker"])
        threads = GaugeMetricFamily("servewell_worker_threads", "Worker OS threads.", labels=["model", "worker"])
        pool = _PoolGauges()
        for model in models:
            pool.add(model)
            for lane, count in model.lane_depths.items():
                depth.add_metric([model.name, lane], count)
            inflight.add_metric([model.name], model.inflight)
            for name in MODEL_STATES:
                state.add_metric([model.name, name], 1.0 if model.state == name else 0.0)
            if model.effective_max_batch_size:
                max_batch.add_metric([model.name], model.effective_max_batch_size)
            for worker in model.workers:
                labels = [model.name, str(worker.instance)]
                up.add_metric(labels, 1.0 if worker.up else 0.0)
                read = facts.get(worker.pid, {}) if worker.up and worker.pid else {}
                if read:
                    rss.add_metric(labels, read["rss_bytes"])
                    private.add_metric(labels, read["private_bytes"])
                    if "file_bytes" in read:
                        mapped.add_metric(labels, read["file_bytes"])
                    cpu.add_metric(labels, read["cpu_seconds"])
                    threads.add_metric(labels, read["threads"])
            yield None
        yield from (depth, inflight, state, up, max_batch, rss, private, mapped, cpu, threads)
        yield from pool.families()
        if self._ready is not None:
            ready = GaugeMetricFamily("servewell_ready", "1 when the server reports ready (its readiness policy).")
            ready.add_metric([], 1.0 if self._ready() else 0.0)
            yield ready
        if self._budget is not None:
            total, reserved = self._budget()
            budget = GaugeMetricFamily("servewell_memory_budget_bytes", "Host memory budget for models.",
                                       labels=["kind"])
            budget.add_metric(["total"], total)
            budget.add_metric(["reserved"], reserved)
            if self._device_budget is not None:  # GPU memory promised to models, apart from the host's
                device_total, device_reserved = self._device_budget()
                if device_total is not None:  # absent when the device is not limited: no fake total
                    budget.add_metric(["device_total"], device_total)
                budget.add_metric(["device_reserved"], device_reserved)
            yield budget
        gpus = self._gpus() if self._gpus is not None else []
        if gpus:  # absent on machines without a GPU: no fake zeros
            families = {
                "utilization_ratio": GaugeMetricFamily("servewell_gpu_utilization_ratio", "GPU busy share.",
                                                       labels=["gpu"]),
                "memory_used_bytes": GaugeMetricFamily("servewell_gpu_memory_used_bytes", "GPU memory used.",
                                                       labels=["gpu"]),
                "memory_total_bytes": GaugeMetricFamily("servewell_gpu_memory_total_bytes", "GPU memory.",
                                                        labels=["gpu"]),
                "power_watts": GaugeMetricFamily("servewell_gpu_power_watts", "GPU power draw.", labels=["gpu"]),
                "temperature_celsius": GaugeMetricFamily("servewell_gpu_temperature_celsius", "GPU temperature.",
                                                         labels=["gpu"]),
            }
            for gpu in gpus:
                for key, family in families.items():
                    if key in gpu:
                        family.add_metric([str(int(gpu["index"]))], gpu[key])
            yield from families.values()


def _read_every(read: ProcessReader, pids: list[int]) -> dict[int, dict[str, float]]:
    """Each pid's facts (a process gone since reads as {})."""
    return {pid: read(pid) for pid in pids}


def _live_pids(models: list[ModelSample]) -> list[int]:
    """The pids of the models' live workers, each once, in order."""
    return list(dict.fromkeys(w.pid for m in models for w in m.workers if w.up and w.pid))


class _PoolGauges:
    """The model pool's per-model gauges (engine/model_pool.py) and the count of models per
    residency, filled from one scrape's `ModelSample`s."""

    def __init__(self) -> None:
        self.resident = GaugeMetricFamily(
            "servewell_model_resident", "1 when the model is loaded and takes requests (resident); 0 when it is "
            "loading, evicted, not loaded (lazy mode), failed or invalid.", labels=["model"])
        self.pinned = GaugeMetricFamily("servewell_model_pinned", "1 when the model is pinned (never evicted).",
                                        labels=["model"])
        self.last_used = GaugeMetricFamily(
            "servewell_model_last_used_timestamp_seconds", "Unix time of the model's last request (absent until "
            "its first).", labels=["model"])
        self.estimated = GaugeMetricFamily(
            "servewell_model_estimated_bytes", "Host memory the model's instances are estimated to need (what a "
            "load reserves in the memory budget).", labels=["model"])
        self.by_residency = GaugeMetricFamily(
            "servewell_model_pool_models", "Models of the repository by residency (resident, loading, evicted, "
            "not_loaded, failed, invalid).", labels=["residency"])
        self.cache_bytes = GaugeMetricFamily(
            "servewell_response_cache_bytes", "Bytes of answers the model's response cache keeps (models with "
            "cache: only).", labels=["model"])
        self.cache_entries = GaugeMetricFamily(
            "servewell_response_cache_entries", "Answers the model's response cache keeps.", labels=["model"])
        self._counts = dict.fromkeys(RESIDENCIES, 0)

    def add(self, model: ModelSample) -> None:
        """Count one model and add its series."""
        self.resident.add_metric([model.name], 1.0 if model.residency == "resident" else 0.0)
        self.pinned.add_metric([model.name], 1.0 if model.pinned else 0.0)
        if model.last_used_at is not None:
            self.last_used.add_metric([model.name], model.last_used_at)
        if model.estimated_bytes is not None:
            self.estimated.add_metric([model.name], model.estimated_bytes)
        if model.cache_bytes is not None:
            self.cache_bytes.add_metric([model.name], model.cache_bytes)
            self.cache_entries.add_metric([model.name], model.cache_entries)
        self._counts[model.residency] = self._counts.get(model.residency, 0) + 1

    def families(self) -> list[Metric]:
        """Every family, the per-residency counts added."""
        for residency, count in self._counts.items():
            self.by_residency.add_metric([residency], count)
        return [self.resident, self.pinned, self.last_used, self.estimated, self.by_residency, self.cache_bytes,
                self.cache_entries]


class ProcessRestartsCollector(Collector):
    """`servewell_process_restarts_total{role}`: how often the supervisor restarted the engine or
    an ingress process (read at scrape time from what the supervisor writes down)."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("servewell_process_restarts", "Processes of the server restarted by the "
                                     "supervisor after they died, by role (engine, ingress).", labels=["role"])
        counts = self._read()
        for role in ("engine", "ingress"):
            family.add_metric([role], float(counts.get(role, 0)))
        return [family]


class ViewsCollector(Collector):
    """Gauges of the console feed's latest tick, read at scrape time: each model's diagnosis
    (`servewell_diagnosis{model,cause}`: 1 for the cause its reading names, the only series of the
    model; observability/diagnosis.py) and the server's own processes' resident memory
    (`servewell_process_resident_memory_bytes{process}`: the engine and each ingress process, named as
    in the console and /healthz; workers have `servewell_worker_resident_memory_bytes`)."""

    def __init__(self, diagnoses: Callable[[], Mapping[str, Diagnosis]],
                 processes: Callable[[], Iterable[Mapping[str, object]]]) -> None:
        self._diagnoses = diagnoses
        self._processes = processes

    def collect(self) -> Iterable[Metric]:
        diagnosis = GaugeMetricFamily(
            "servewell_diagnosis", "1 for the cause the server's reading of the model names now, read in order: "
            "tenant_holds_lane, cache_ttl_short, worker_replaced, cpu_contention, then the stages (capacity, "
            "slow_batch, batch_size, preprocess, postprocess, compute, none; no_traffic, unknown).",
            labels=["model", "cause"])
        for model, found in sorted(self._diagnoses().items()):
            diagnosis.add_metric([model, found.cause], 1.0)
        memory = GaugeMetricFamily(
            "servewell_process_resident_memory_bytes", "Resident memory (RSS) of the server's own processes, by "
            "process: engine, ingress N (the single-process server: engine only).", labels=["process"])
        for row in self._processes():
            if row.get("role") in ("engine", "ingress"):
                memory.add_metric([str(row["name"])], float(row["rss_bytes"]))  # type: ignore[arg-type]
        return [diagnosis, memory]


@dataclass(slots=True, frozen=True)
class RolloutGauges:
    """One model's traffic split as the scrape shows it (engine/rollout.py)."""

    model: str
    state: str  # steady, canary, rolled_back, promoted
    shares: dict[str, float]  # version -> share of the requests that name no version, in force
    rolled_back: dict[str, float]  # version -> 1 while it stands rolled back


ROLLOUT_STATES = ("steady", "canary", "rolled_back", "promoted")


class RolloutCollector(Collector):
    """Gauges of every traffic split, read from the engine at scrape time."""

    def __init__(self, read: Callable[[], Iterable[RolloutGauges]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        weight = GaugeMetricFamily("servewell_rollout_weight", "Share of a model's requests (those naming no "
                                   "version) each version takes now.", labels=["model", "version"])
        rolled = GaugeMetricFamily("servewell_rollout_rolled_back", "1 while a version stands rolled back by a "
                                   "rule (until model.yaml's traffic or an admin changes the weights).",
                                   labels=["model", "version"])
        state = GaugeMetricFamily("servewell_rollout_state", "1 for the state each traffic split is in (steady, "
                                  "canary, rolled_back, promoted).", labels=["model", "state"])
        for rollout in self._read():
            for version, share in rollout.shares.items():
                weight.add_metric([rollout.model, version], share)
            for version, value in rollout.rolled_back.items():
                rolled.add_metric([rollout.model, version], value)
            for name in ROLLOUT_STATES:
                state.add_metric([rollout.model, name], 1.0 if rollout.state == name else 0.0)
        return [weight, rolled, state]
