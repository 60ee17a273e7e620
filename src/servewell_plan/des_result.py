"""What a request-level run reports: every request's arrival, latency and outcome, time bins as a
dashboard would show them, and statistics over any window of arrival times."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewell_plan.model import BinStats

#: `SimResult.status` values.
ANSWERED, REFUSED, FAILED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class WindowStats:
    """The requests that arrived in one window of time, and what became of them."""

    arrivals: int
    ok: int  # answered
    rejected: int  # refused: 503 (batcher queue full, or no ready replica)
    failed: int  # lost with a replica
    throughput_rps: float  # answered requests that arrived in the window / the window's length
    p50_s: float | None  # latency of the answered ones (None: none answered)
    p99_s: float | None
    mean_s: float | None
    within_slo: int | None  # answered within the run's SLO (None: the run had none)


@dataclass(slots=True)
class SimResult:
    """One run. Every request sent before the end of the load is followed to its outcome, so none
    is left in flight: `arrivals == ok + rejected + failed` for any window."""

    bin_s: float
    slo_s: float | None
    arrival_s: np.ndarray  # float64 per request: when it reached the balancer
    latency_s: np.ndarray  # float64 per request: answer - arrival + overhead + balancer latency; nan unless answered
    status: np.ndarray  # int8 per request: 0 answered, 1 refused (503), 2 failed (lost with a replica)
    bins: list[BinStats]
    replica_seconds: float  # pods that cost money (starting, ready, draining), integrated over the load's duration
    replica_cpu_s: float = 0.0  # CPU seconds the replicas worked (fronts and batches), the whole run

    @property
    def cpu_per_answer_s(self) -> float:
        """The replicas' CPU seconds per answered request over the whole run (inf: none answered)."""
        answered = int((self.status == ANSWERED).sum())
        return self.replica_cpu_s / answered if answered else float("inf")

    def window(self, start_s: float, end_s: float) -> WindowStats:
        """Statistics of the requests that arrived in [start_s, end_s)."""
        inside = (self.arrival_s >= start_s) & (self.arrival_s < end_s)
        return window_stats(self.latency_s[inside], self.status[inside], end_s - start_s, self.slo_s)


def window_stats(latency_s: np.ndarray, status: np.ndarray, length_s: float, slo_s: float | None) -> WindowStats:
    """Statistics of one set of requests that arrived over `length_s` seconds."""
    answered = latency_s[status == ANSWERED]
    ok = int(answered.size)
    p50 = p99 = mean = None
    if ok:
        q50, q99 = np.quantile(answered, (0.5, 0.99))
        p50, p99, mean = float(q50), float(q99), float(answered.mean())
    return WindowStats(
        arrivals=int(status.size),
        ok=ok,
        rejected=int(np.count_nonzero(status == REFUSED)),
        failed=int(np.count_nonzero(status == FAILED)),
        throughput_rps=ok / length_s if length_s > 0 else 0.0,
        p50_s=p50,
        p99_s=p99,
        mean_s=mean,
        within_slo=None if slo_s is None else int(np.count_nonzero(answered <= slo_s)),
    )


def build_bins(
    arrival_s: np.ndarray,
    latency_s: np.ndarray,
    status: np.ndarray,
    *,
    bin_s: float,
    horizon_s: float,
    slo_s: float | None,
    ready_area: list[float],
    paid_area: list[float],
    depth_sum: list[float],
    depth_n: list[int],
) -> list[BinStats]:
    """One BinStats per bin: requests by arrival time, pod counts time-averaged over the bin, queue
    depth the mean of the bin's scrapes (0 when no pod was ready at any of them). The last bin may
    end early, at `horizon_s`: its pod counts are averaged over what it covers."""
    count = len(paid_area)
    index = np.minimum((arrival_s // bin_s).astype(np.int64), count - 1)
    order = np.argsort(index, kind="stable")
    edges = np.searchsorted(index[order], np.arange(count + 1))
    bins = []
    for b in range(count):
        picked = order[edges[b] : edges[b + 1]]
        length = max(min(bin_s, horizon_s - b * bin_s), 1e-12)
        stats = window_stats(latency_s[picked], status[picked], length, slo_s)
        bins.append(
            BinStats(
                start_s=b * bin_s,
                arrivals=stats.arrivals,
                ok=stats.ok,
                rejected=stats.rejected,
                failed=stats.failed,
                p50_s=stats.p50_s,
                p99_s=stats.p99_s,
                within_slo=stats.within_slo or 0,
                replicas_ready=ready_area[b] / length,
                replicas_total=paid_area[b] / length,
                queue_depth=depth_sum[b] / depth_n[b] if depth_n[b] else 0.0,
            )
        )
    return bins
