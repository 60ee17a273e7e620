"""One replica's latency against its load, measured on the request-level simulator: the table the
fluid fleet model reads, and the curve `servewell plan` picks its operating point from.

Each row is a Poisson load at a share of the replica's capacity. Poisson arrivals at each replica
are the conservative case: a round-robin balancer spreads a Poisson stream more evenly than that,
least-connections and power-of-two choices more evenly still.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import FleetSpec, LatencyTable, ReplicaModel, Trace

UTILIZATIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.96, 0.98)
QUANTILES = (*(i / 100 for i in range(1, 100)), 0.995, 0.999)
#: Simulated requests per row (the p99 of a row rests on its slowest 1 %: 60 of them).
REQUESTS_PER_ROW = 6000


@dataclass(frozen=True, slots=True)
class LoadRow:
    """What one utilization row measured, beyond the latency quantiles."""

    utilization: float
    mean_s: float
    p50_s: float
    p99_s: float
    rejected_share: float
    queue_depth: float  # mean requests held beyond the lowest load's latency, by Little's law


def capacity_rps(replica: ReplicaModel, seed: int = 0) -> float:
    """The replica's saturation throughput on the simulator: a closed loop with enough clients to
    keep every instance's batch full."""
    clients = 2 * replica.instances * replica.max_batch_size + 4
    duration = max(REQUESTS_PER_ROW / replica.saturation_rps, 10 * replica.batch_s(replica.max_batch_size))
    result = simulate(FleetSpec(replica, 1), ClosedLoad(clients, duration), seed=seed)
    return result.window(0.2 * duration, duration).throughput_rps


def build_table(replica: ReplicaModel, *, seed: int = 0,
                utilizations: tuple[float, ...] = UTILIZATIONS) -> tuple[LatencyTable, list[LoadRow]]:
    """The latency table of `replica` and a summary row per utilization."""
    capacity = capacity_rps(replica, seed)
    latencies: list[tuple[float, ...]] = []
    rejected: list[float] = []
    rows: list[LoadRow] = []
    base_mean: float | None = None
    for rho in utilizations:
        rate = rho * capacity
        duration = REQUESTS_PER_ROW / rate
        trace = Trace(step_s=duration, rates_rps=(rate,))
        result = simulate(FleetSpec(replica, 1), OpenLoad(trace), seed=seed)
        window = result.window(0.1 * duration, duration)
        answered = result.latency_s[(result.status == 0) & (result.arrival_s >= 0.1 * duration)]
        if answered.size == 0:
            raise ValueError(f"the replica answered nothing at {rho:.0%} of its capacity")
        qs = tuple(float(v) for v in np.quantile(answered, QUANTILES))
        mean = float(answered.mean())
        base_mean = mean if base_mean is None else base_mean
        refused = (window.rejected + window.failed) / window.arrivals if window.arrivals else 0.0
        latencies.append(qs)
        rejected.append(refused)
        rows.append(LoadRow(rho, mean, qs[49], qs[-2], refused, max(0.0, rate * (mean - base_mean))))
    table = LatencyTable(capacity, utilizations, QUANTILES, tuple(latencies), tuple(rejected))
    return table, rows


def highest_load_within(rows: list[LoadRow], slo_s: float, error_budget: float) -> LoadRow | None:
    """The busiest row whose p99 meets `slo_s` and whose refusals fit the error budget, provided every
    lighter row does too (a curve that dips back under the SLO past a violation is not trusted)."""
    best = None
    for row in rows:
        if row.p99_s > slo_s or row.rejected_share > error_budget:
            break
        best = row
    return best


def interpolate(rows: list[LoadRow], utilization: float, field: str) -> float:
    """A row field at any utilization, linear between rows (clamped at the ends)."""
    xs = [r.utilization for r in rows]
    ys = [getattr(r, field) for r in rows]
    value = float(np.interp(utilization, xs, ys))
    return value if math.isfinite(value) else ys[-1]
