"""What is wrong with a model, read from its evidence in a fixed order, each reading naming its evidence.

The console's per-model reading, `/healthz`'s and every alert's advice come from here, so they
cannot disagree. The rules are pure (evidence in, one `Diagnosis` out: no clock, no I/O), tried in
this order, the first that holds giving the reading:

1. `tenant_holds_lane`: one tenant holds most of a lane (at least `TENANT_SHARE` of its places,
   more than its weight's share, the lane at least `LANE_FILL` full), now or in at least
   `HOLDING_TICKS_SHARE` of the window's samples: the queue is one caller's, not a lack of
   capacity, so the advice is that tenant's quotas, never "add instances";
2. `cache_ttl_short`: the response cache's TTL is shorter than its inputs' reuse interval: at least
   `MIN_REUSES` repeated inputs in the window, at least `BEYOND_TTL_SHARE` of them after their
   answer expired, and the hit ratio under `LOW_HIT_RATIO`;
3. `worker_replaced`: a worker of the model was replaced (memory, crash, hang) within the window, or
   a replacement is under way; the gap it caused is named (with no other instance serving, every
   request waited it: the queue wait is that gap, not slow batches nor capacity);
4. `cpu_contention`: the host's CPU is contended (pressure stall `some avg10` at least
   `CPU_PRESSURE`, or a load of `LOAD_PER_CPU` per usable CPU) while the model is slow (queue wait
   at least half its p99, or compute p99 at least `CPU_JITTER` times its p50): adding instances
   would make it worse;
5. the stages of its p99 (`latency_reading.py`): capacity, one slow batch, compute growing with
   batch size, decoding, encoding, the model itself, or no stage dominating.

A reading that cannot tell says so (`unknown`: too few requests in the window); a model with no
traffic and nothing found reads `no_traffic`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from servewell.observability.latency_reading import LatencySplit

#: Causes in the order they are tried; then the stage causes of `latency_reading.STAGE_CAUSES`.
CAUSES_FIRST = ("tenant_holds_lane", "cache_ttl_short", "worker_replaced", "cpu_contention")
#: Every cause a diagnosis can name (the values of `servewell_diagnosis{cause}`).
CAUSES = (*CAUSES_FIRST, "capacity", "slow_batch", "batch_size", "preprocess", "postprocess", "compute", "none",
          "no_traffic", "unknown")

#: A tenant "holds most of a lane" at this share of its places or more...
TENANT_SHARE = 0.5
#: ... while the lane is at least this full ...
LANE_FILL = 0.5
#: ... now, or in at least this share of the window's samples.
HOLDING_TICKS_SHARE = 0.25
#: Repeated inputs needed in the window before the cache rule reads anything.
MIN_REUSES = 5
#: Share of repeated inputs that came after their answer expired, at or above which the TTL is short.
BEYOND_TTL_SHARE = 0.5
#: The cache rule holds only while fewer lookups than this share are hits.
LOW_HIT_RATIO = 0.5
#: CPU pressure (share of time some task waited for a CPU, /proc/pressure/cpu avg10) that is contention.
CPU_PRESSURE = 0.25
#: Load average per usable CPU that is contention where pressure is not available.
LOAD_PER_CPU = 1.5
#: Compute p99 over p50 at or above which a model's compute jitters (with contention: others take its CPU).
CPU_JITTER = 2.0
#: Fewer answered requests than this in the window: a slow-looking p99 cannot be read.
MIN_REQUESTS = 5


@dataclass(slots=True, frozen=True)
class LaneHolding:
    """Who held one lane's places at one sample: places per tenant label, and the lane's bound."""

    lane: str
    depth: int
    max_queue_size: int
    places: Mapping[str, int]
    weight_share: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight / sum of holders' weights

    def holder(self) -> tuple[str, int, float] | None:
        """The tenant holding most of the lane beyond its weight's share (tenant, places, share of
        the places), when the lane is at least `LANE_FILL` full and it holds `TENANT_SHARE`; else None."""
        if self.max_queue_size <= 0 or self.depth < LANE_FILL * self.max_queue_size or not self.places:
            return None
        tenant, count = max(self.places.items(), key=lambda item: (item[1], item[0]))
        share = count / max(1, self.depth)
        if tenant == "-" and len(self.places) == 1:
            return None  # no keys: who fills the lane cannot be told apart from anyone else
        if share < TENANT_SHARE or share <= self.weight_share.get(tenant, 0.0):
            return None
        return tenant, count, share


@dataclass(slots=True, frozen=True)
class CacheFacts:
    """A response cache over the window: settings, lookups, repeated inputs against the TTL."""

    ttl_s: float
    hits: float
    coalesced: float
    misses: float
    reused_within: float
    reused_beyond: float
    reuse_p50_s: float | None = None  # median interval between repeats (None: none repeated)

    @property
    def hit_ratio(self) -> float | None:
        """Hits over lookups in the window (None: no lookup)."""
        lookups = self.hits + self.coalesced + self.misses
        return self.hits / lookups if lookups > 0 else None


@dataclass(slots=True, frozen=True)
class ReplacementFact:
    """One worker replacement of the model within the window (observability/worker_events.py)."""

    instance: int
    reason: str  # crash, hung, memory
    detail: str
    at: float  # Unix time it left service
    gap_s: float | None  # None: not ready yet
    open_s: float | None  # how long an unfinished one has run
    others_serving: int


@dataclass(slots=True, frozen=True)
class CpuFacts:
    """The host's CPU: pressure stall (`some avg10`, a share; None where the kernel has none), the
    1-minute load and the CPUs the server may use."""

    pressure: float | None
    load1: float | None
    cpus: int

    def contended(self) -> bool:
        """Whether tasks wait for a CPU enough to slow serving."""
        if self.pressure is not None:
            return self.pressure >= CPU_PRESSURE
        return self.load1 is not None and self.load1 >= LOAD_PER_CPU * max(1, self.cpus)

    def describe(self) -> str:
        """The figures, for a reading's evidence."""
        parts = []
        if self.pressure is not None:
            parts.append(f"tasks waited for a CPU {self.pressure * 100:.0f}% of the last 10 s (PSI)")
        if self.load1 is not None:
            parts.append(f"load {self.load1:.1f} on {self.cpus} CPU{'s' if self.cpus != 1 else ''}")
        return ", ".join(parts) or "no CPU figures"


@dataclass(slots=True, frozen=True)
class ModelEvidence:
    """Everything a diagnosis of one model reads (built each console tick by api/diagnosis_evidence.py)."""

    model: str
    window_s: float
    answered: float  # requests answered in the window (every outcome)
    split: LatencySplit
    summary: Mapping[str, Any] | None = None
    refusals: Mapping[tuple[str, str, str], float] = field(default_factory=dict)  # (lane, tenant, reason) -> count
    holdings: Sequence[LaneHolding] = ()  # now
    held_in_window: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (lane, tenant) -> share of samples
    cache: CacheFacts | None = None
    replacements: Sequence[ReplacementFact] = ()
    cpu: CpuFacts | None = None
    memory_growth: Mapping[int, tuple[float | None, float | None]] = field(default_factory=dict)
    #: instance -> (resident memory growth in bytes/s, seconds to its limit), for a memory reading


@dataclass(slots=True, frozen=True)
class Diagnosis:
    """The reading of one model: its cause, one line, the evidence it rests on and what to do."""

    cause: str
    reading: str
    evidence: tuple[str, ...]
    advice: str

    def to_json(self) -> dict[str, Any]:
        """As the console and `/healthz` show it."""
        doc = asdict(self)
        doc["evidence"] = list(self.evidence)
        return doc

    @property
    def found(self) -> bool:
        """Whether a cause before the stages' own was found (alerts then give its advice)."""
        return self.cause in CAUSES_FIRST


def diagnose(evidence: ModelEvidence) -> Diagnosis:
    """The first rule of the module docstring that holds for `evidence`."""
    for rule in (_tenant_holds_lane, _cache_ttl_short, _worker_replaced, _cpu_contention):
        found = rule(evidence)
        if found is not None:
            return found
    return _stages(evidence)


def _refused_by_tenant(evidence: ModelEvidence, lane: str | None = None) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (refused_lane, tenant, _reason), count in evidence.refusals.items():
        if lane is None or refused_lane == lane:
            totals[tenant] = totals.get(tenant, 0.0) + count
    return totals


def _tenant_holds_lane(evidence: ModelEvidence) -> Diagnosis | None:
    now = [(h, found) for h in evidence.holdings if (found := h.holder()) is not None]
    if now:
        holding, (tenant, count, share) = max(now, key=lambda item: item[1][2])
        lane = holding.lane
        figures = (f"tenant '{tenant}' holds {count} of {holding.depth} queued places of lane '{lane}' "
                   f"({share * 100:.0f}%; its weight's share is {holding.weight_share.get(tenant, 0.0) * 100:.0f}%), "
                   f"the lane {holding.depth} of {holding.max_queue_size} full")
    else:
        held = [(key, share) for key, share in evidence.held_in_window.items() if share >= HOLDING_TICKS_SHARE]
        if not held:
            return None
        (lane, tenant), ticks = max(held, key=lambda item: item[1])
        figures = (f"tenant '{tenant}' held most of lane '{lane}' in {ticks * 100:.0f}% of the samples of the "
                   f"last {evidence.window_s:.0f} s")
    evidence_lines = [figures]
    refused = _refused_by_tenant(evidence, lane)
    if refused:
        evidence_lines.append("refused in the last {:.0f} s: {}".format(
            evidence.window_s, ", ".join(f"'{t}' {n:.0f}" for t, n in sorted(refused.items(), key=lambda i: -i[1]))))
    return Diagnosis(
        "tenant_holds_lane",
        f"one tenant fills the queue: '{tenant}' holds most of lane '{lane}' (not a lack of capacity)",
        tuple(evidence_lines),
        f"limit tenant '{tenant}': PATCH /admin/tenants/{tenant} with a lower max_queued (places per model) or "
        "rate_per_s, or a lower weight; fair admission already refuses its newest requests first, so adding "
        "instances or max_batch_size would only let it take more")


def _cache_ttl_short(evidence: ModelEvidence) -> Diagnosis | None:
    cache = evidence.cache
    if cache is None:
        return None
    reused = cache.reused_within + cache.reused_beyond
    ratio = cache.hit_ratio
    if reused < MIN_REUSES or cache.reused_beyond < BEYOND_TTL_SHARE * reused:
        return None
    if ratio is not None and ratio >= LOW_HIT_RATIO:
        return None
    typical = f"; half came back after {cache.reuse_p50_s:.1f} s or more" if cache.reuse_p50_s is not None else ""
    suggest = max(cache.ttl_s * 2, (cache.reuse_p50_s or cache.ttl_s) * 2)
    return Diagnosis(
        "cache_ttl_short",
        f"the response cache's TTL ({cache.ttl_s:g} s) is shorter than its inputs' reuse interval: answers "
        "expire before they are asked for again",
        (f"{cache.reused_beyond:.0f} of {reused:.0f} repeated inputs in the last {evidence.window_s:.0f} s came "
         f"after their answer expired (ttl_s {cache.ttl_s:g}){typical}",
         "hit ratio " + ("–" if ratio is None else f"{ratio * 100:.0f}%") +
         f" ({cache.hits:.0f} hits, {cache.misses:.0f} misses, {cache.coalesced:.0f} shared)"),
        f"raise cache.ttl_s above the reuse interval if answers that old are still right (model.yaml, or PATCH "
        f"/admin/models/{evidence.model}/cache {{\"ttl_s\": {suggest:.0f}}}); batch size and instances are not "
        "the cause of this compute")


def _bytes(value: float) -> str:
    return f"{value / (1 << 20):.0f} MiB"


def _worker_replaced(evidence: ModelEvidence) -> Diagnosis | None:
    events = list(evidence.replacements)
    if not events:
        return None
    last = max(events, key=lambda e: e.at)
    reasons: dict[str, int] = {}
    for event in events:
        reasons[event.reason] = reasons.get(event.reason, 0) + 1
    counted = ", ".join(f"{n} for {r}" for r, n in sorted(reasons.items()))
    lines = [f"{len(events)} replacement{'s' if len(events) != 1 else ''} in the last {evidence.window_s:.0f} s "
             f"({counted}); the last: instance #{last.instance}, {last.detail}"]
    waited = [e for e in events if e.others_serving == 0]
    if last.gap_s is None:
        gap = f"a replacement is under way ({last.open_s or 0:.1f} s so far)"
    else:
        gap = f"its gap was {last.gap_s:.1f} s"
    if waited:
        worst = max((e.gap_s if e.gap_s is not None else e.open_s or 0.0) for e in waited)
        gap += f"; with no other instance serving, requests waited up to {worst:.1f} s (counted as queue wait)"
    else:
        gap += "; other instances kept serving, on less capacity"
    lines.append(gap)
    growth, left = evidence.memory_growth.get(last.instance, (None, None))
    if last.reason == "memory" and growth is not None and growth > 0:
        lines.append(f"the worker's resident memory grows {growth * 60 / (1 << 20):.1f} MiB/min"
                     + (f", at its limit in {left:.0f} s" if left else ""))  # 0: the old one, already past it
    advice = {
        "memory": "the worker passes host_memory_limit_bytes and is drained and replaced: look for a leak in the "
                  "model's code (its memory series in the console), or raise the limit",
        "crash": "the worker died: read its exit in /healthz (last_failure) and the log line 'worker ... died'",
        "hung": "the worker stopped making progress (no heartbeat, or a batch over its compute budget): look for a "
                "stuck model call or raise batching.compute_timeout_ms",
    }[last.reason if last.reason in ("memory", "crash", "hung") else "crash"]
    if waited:
        advice += "; with instances: 2 or more a replacement leaves one serving"
    return Diagnosis(
        "worker_replaced",
        f"worker replaced ({last.reason}): the gap of the replacement, not slow batches or capacity",
        tuple(lines), advice)


def _slow(evidence: ModelEvidence) -> bool:
    """Whether the model shows what CPU contention causes: requests waiting in its queue (queue wait at
    least half its p99), or compute time jittering (its p99 at least `CPU_JITTER` times its p50). A
    fast model whose compute is simply the largest stage is not slow."""
    split = evidence.split
    p99 = split.p99_ms or 0.0
    if p99 <= 0:
        return False
    if (split.queue_ms or 0.0) >= 0.5 * p99:
        return True
    summary = evidence.summary or {}
    compute_p50, compute_p99 = summary.get("compute_p50_ms"), summary.get("compute_p99_ms")
    return bool(compute_p50 and compute_p99 and compute_p99 >= CPU_JITTER * compute_p50)


def _cpu_contention(evidence: ModelEvidence) -> Diagnosis | None:
    cpu = evidence.cpu
    if cpu is None or not cpu.contended() or not _slow(evidence) or evidence.answered < MIN_REQUESTS:
        return None
    return Diagnosis(
        "cpu_contention",
        "the host's CPU is contended: the model's processes wait for a CPU",
        (f"host: {cpu.describe()}", _stage_line(evidence.split)),
        "find what else runs on the host (top: servewell's processes name themselves); give the server its own "
        "CPUs or lower threads and instances so they stop competing; adding instances would make it worse")


def _stage_line(split: LatencySplit) -> str:
    parts = [(name, value) for name, value in (("queue", split.queue_ms), ("compute", split.compute_ms),
                                               ("preprocess", split.preprocess_ms),
                                               ("postprocess", split.postprocess_ms)) if value]
    shown = " · ".join(f"{name} {value:.1f} ms" for name, value in parts) or "no stage measured"
    return f"p99 {split.p99_ms or 0:.1f} ms: {shown}"


_STAGE_ADVICE = {
    "capacity": "add throughput: raise instances in model.yaml (then POST /v2/repository/models/{model}/load) or "
                "max_batch_size (PATCH /admin/models/{model}/batching); nothing earlier in the reading order "
                "explains the queue",
    "slow_batch": "find the slow batches (the console's recent slow requests, batch ids): a rare long input, or the "
                  "host pausing the worker",
    "batch_size": "lower max_batch_size for latency (PATCH /admin/models/{model}/batching), or add compute",
    "preprocess": "raise decode_threads, or send smaller images",
    "postprocess": "ask for fewer outputs, or the binary tensor format",
    "compute": "the model itself: a faster runtime or device, fewer threads contending, a smaller model",
    "none": "nothing to do",
    "no_traffic": "nothing to do",
}


def _stages(evidence: ModelEvidence) -> Diagnosis:
    split = evidence.split
    if split.cause == "no_traffic":
        return Diagnosis("no_traffic", "no inference requests in the window", (), "nothing to do")
    if evidence.answered < MIN_REQUESTS:
        return Diagnosis("unknown", f"too few requests in the last {evidence.window_s:.0f} s to tell "
                         f"({evidence.answered:.0f})", (_stage_line(split),), "wait for more traffic")
    lines = [_stage_line(split)]
    refused = _refused_by_tenant(evidence)
    if refused:
        lines.append("refused in the last {:.0f} s: {} (every tenant within its share)".format(
            evidence.window_s, ", ".join(f"'{t}' {n:.0f}" for t, n in sorted(refused.items(), key=lambda i: -i[1]))))
    checked = ["no tenant holds most of a lane", "no worker replaced"]
    if evidence.cache is not None:
        checked.append("the cache's TTL outlasts its repeats")
    if evidence.cpu is not None:
        checked.append(f"host CPU not contended ({evidence.cpu.describe()})")
    if split.cause in ("capacity", "slow_batch") or refused:
        lines.append("ruled out: " + "; ".join(checked))
    cause = split.cause
    reading = split.reading
    if cause == "none" and refused:
        cause = "capacity"
        reading = "requests refused by a full lane that every tenant shares within its share: capacity"
    summary = evidence.summary or {}
    compute_p50, compute_p99 = summary.get("compute_p50_ms"), summary.get("compute_p99_ms")
    if cause == "slow_batch" and compute_p50 and compute_p99:
        lines.append(f"compute p99 {compute_p99:.1f} ms against p50 {compute_p50:.1f} ms")
    return Diagnosis(cause, reading, tuple(lines), _STAGE_ADVICE.get(cause, "").format(model=evidence.model))
