"""A model's p99 split into its stages, and a one-line reading of what makes it slow.

Pure rules over figures the console already has (the feed's per-model summary and, when present,
compute time by batch size): no I/O, no clock, so every rule is unit-tested with plain numbers.
The split takes each stage's own p99 (queue wait, preprocess and postprocess per request, compute
per batch) and, when together they exceed the request p99 (p99s do not add up), scales them down
in proportion so they sum to it; what remains under the p99 is time outside the four stages
(transport, the HTTP layer).

The first rule that holds gives the reading, in this order:
1. "compute grows with batch size": compute time per batch at the largest batch size seen is at
   least `GROWTH_FACTOR` times that at the smallest (each size with `MIN_BATCHES` batches), and
   compute is the largest stage; lowering max_batch_size trades throughput for latency;
2. "one slow batch blocks the queue": queue wait dominates while compute's p99 is at least
   `SLOW_BATCH_FACTOR` times its p50: a rare long batch holds everyone queued behind it;
3. "queue wait dominates: capacity": queue wait is at least `DOMINANT_SHARE` of the p99;
4. "preprocessing dominates: decoding" / "postprocessing dominates: encoding" /
   "compute dominates: the model itself": that stage is at least `DOMINANT_SHARE`;
5. "no stage dominates".

Each reading comes with its `cause` (a word of `STAGE_CAUSES`). These are the last step of a
model's diagnosis (`diagnosis.py`), which first rules out a tenant holding most of a lane, a cache
whose TTL is shorter than its inputs' reuse interval, recent worker replacements and host CPU
contention: a queue read here as "capacity" is one no earlier cause explains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: A stage "dominates" at this share of the p99 or more.
DOMINANT_SHARE = 0.5
#: Compute per batch "grows with batch size" when the largest size's p50 is this many times the smallest's.
GROWTH_FACTOR = 1.5
#: A batch size counts for the growth rule only with at least this many batches measured.
MIN_BATCHES = 3
#: Compute p99 over p50 at or above which one slow batch, not steady load, explains a long queue.
SLOW_BATCH_FACTOR = 4.0

STAGES = ("queue", "compute", "preprocess", "postprocess")
#: The cause each stage reading names (`LatencySplit.cause`).
STAGE_CAUSES = ("no_traffic", "batch_size", "slow_batch", "capacity", "preprocess", "postprocess", "compute", "none")


@dataclass(slots=True, frozen=True)
class LatencySplit:
    """A model's p99 and the share of it each stage takes (milliseconds), with the reading."""

    p99_ms: float | None
    queue_ms: float | None
    compute_ms: float | None
    preprocess_ms: float | None
    postprocess_ms: float | None
    reading: str
    cause: str = "none"  # one of STAGE_CAUSES

    def to_json(self) -> dict[str, Any]:
        """The state JSON's `latency_split`."""
        return asdict(self)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else None


def compute_grows_with_batch_size(by_batch_size: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether compute time per batch rises with batch size: `by_batch_size` rows are
    `{batch_size, p50_ms, p99_ms, count}`; sizes with fewer than `MIN_BATCHES` batches are left out."""
    rows = []
    for row in by_batch_size or ():
        size, p50, count = _number(row.get("batch_size")), _number(row.get("p50_ms")), _number(row.get("count"))
        if size is not None and p50 is not None and count is not None and count >= MIN_BATCHES:
            rows.append((size, p50))
    if len(rows) < 2:
        return False
    rows.sort()
    (small_size, small_p50), (large_size, large_p50) = rows[0], rows[-1]
    return large_size > small_size and large_p50 >= GROWTH_FACTOR * max(small_p50, 1e-6)


def latency_split(summary: Mapping[str, Any] | None,
                  by_batch_size: Sequence[Mapping[str, Any]] | None = None) -> LatencySplit:
    """Split the p99 of `summary` (the console feed's per-model summary: `latency_p99_ms`,
    `queue_p99_ms`, `compute_p99_ms`, `compute_p50_ms`, `preprocess_p99_ms`, `postprocess_p99_ms`)
    and read it (rules in the module docstring)."""
    summary = summary or {}
    p99 = _number(summary.get("latency_p99_ms"))
    stages = {stage: _number(summary.get(f"{stage}_p99_ms")) for stage in STAGES}
    if p99 is None or p99 <= 0:
        return LatencySplit(p99, None, None, None, None, "no inference requests in the window", "no_traffic")
    known = sum(v for v in stages.values() if v is not None)
    scale = p99 / known if known > p99 else 1.0
    split = {stage: None if v is None else round(v * scale, 3) for stage, v in stages.items()}
    share = {stage: (v or 0.0) / p99 for stage, v in split.items()}
    largest = max(STAGES, key=lambda stage: share[stage])
    cause, reading = _reading(share, largest, summary, by_batch_size)
    return LatencySplit(p99, split["queue"], split["compute"], split["preprocess"], split["postprocess"],
                        reading, cause)


def _reading(share: Mapping[str, float], largest: str, summary: Mapping[str, Any],
             by_batch_size: Sequence[Mapping[str, Any]] | None) -> tuple[str, str]:
    if largest == "compute" and share["compute"] > 0 and compute_grows_with_batch_size(by_batch_size):
        return "batch_size", "compute grows with batch size: lower max_batch_size for latency, or add compute"
    if share["queue"] >= DOMINANT_SHARE:
        compute_p50, compute_p99 = _number(summary.get("compute_p50_ms")), _number(summary.get("compute_p99_ms"))
        if compute_p50 and compute_p99 is not None and compute_p99 >= SLOW_BATCH_FACTOR * compute_p50:
            return "slow_batch", "one slow batch blocks the queue: compute p99 is many times its p50"
        return "capacity", "queue wait dominates: capacity (add instances or raise max_batch_size)"
    if share["preprocess"] >= DOMINANT_SHARE:
        return "preprocess", "preprocessing dominates: decoding (raise decode_threads, send smaller images)"
    if share["postprocess"] >= DOMINANT_SHARE:
        return "postprocess", "postprocessing dominates: encoding the response"
    if share["compute"] >= DOMINANT_SHARE:
        return "compute", "compute dominates: the model itself"
    return "none", "no stage dominates"
