"""Time bins of a fluid run: the counts of each bin and the latency percentiles of its answered
requests, from the mixture of the per-replica latency distributions weighted by their requests.

Each step adds its replica cohorts (dense utilization row, latency shift, requests). At the end of a
bin, cohorts are merged into cells (utilization to 1/100, shift to 5 % relative), each cell taking
the request-weighted mean row and shift of its members, and the cells' mixture is inverted for p50
and p99 (`DenseLatency.mixture_quantiles`).
"""

from __future__ import annotations

import math

import numpy as np

from servewell_plan.fluid_table import RHO_STEPS, DenseLatency
from servewell_plan.model import BinStats

#: Cells merge utilization rows this many dense rows wide (1/100 utilization).
_ROWS_PER_CELL = RHO_STEPS // 100
#: Shifts under this many seconds share the first cell; above, cells are 5 % apart.
_SHIFT_FLOOR_S = 1e-4
_SHIFT_RATIO = math.log(1.05)


class BinAccumulator:
    """The bins of one run, filled step by step."""

    def __init__(self, dense: DenseLatency, bin_s: float) -> None:
        self._dense = dense
        self._bin_s = float(bin_s)
        self.bins: list[BinStats] = []
        self._index = 0
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._arrivals = self._ok = self._rejected = self._failed = self._within = 0.0
        self._ready = self._total = self._depth = 0.0
        self._rows: list[np.ndarray] = []
        self._shifts: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []

    def at(self, now_s: float) -> None:
        """Close every bin that ends at or before `now_s`."""
        while now_s >= (self._index + 1) * self._bin_s - 1e-9:
            self._close()

    def add_step(
        self,
        *,
        arrivals: float,
        ok: float,
        rejected: float,
        within: float,
        ready: int,
        total: int,
        depth: float,
        rows: np.ndarray,
        shifts: np.ndarray,
        weights: np.ndarray,
    ) -> None:
        """One step's counts; `rows`, `shifts` and `weights` describe its answered requests."""
        self._steps += 1
        self._arrivals += arrivals
        self._ok += ok
        self._rejected += rejected
        self._within += within
        self._ready += ready
        self._total += total
        self._depth += depth
        if weights.size:
            self._rows.append(rows)
            self._shifts.append(shifts)
            self._weights.append(weights)

    def add_failure(self, lost: float, within_lost: float) -> None:
        """Requests lost with a pod: counted answered when accepted, failed now instead."""
        self._failed += lost
        self._ok -= lost
        self._within -= within_lost

    def finish(self) -> list[BinStats]:
        """Close the last bin and return them all."""
        if self._steps:
            self._close()
        return self.bins

    def _close(self) -> None:
        p50 = p99 = None
        if self._weights:
            weight = np.concatenate(self._weights)
            keep = weight > 0
            if keep.any():
                p50, p99 = self._percentiles(
                    np.concatenate(self._rows)[keep], np.concatenate(self._shifts)[keep], weight[keep]
                )
        steps = max(self._steps, 1)
        self.bins.append(
            BinStats(
                start_s=self._index * self._bin_s,
                arrivals=round(self._arrivals),
                ok=round(max(self._ok, 0.0)),
                rejected=round(self._rejected),
                failed=round(self._failed),
                p50_s=p50,
                p99_s=p99,
                within_slo=round(max(self._within, 0.0)),
                replicas_ready=self._ready / steps,
                replicas_total=self._total / steps,
                queue_depth=self._depth / steps,
            )
        )
        self._index += 1
        self._reset()

    def _percentiles(self, rows: np.ndarray, shifts: np.ndarray, weight: np.ndarray) -> tuple[float, float]:
        bucket = np.where(
            shifts < _SHIFT_FLOOR_S,
            0,
            1 + np.floor(np.log(np.maximum(shifts, _SHIFT_FLOOR_S) / _SHIFT_FLOOR_S) / _SHIFT_RATIO),
        )
        key = (rows // _ROWS_PER_CELL) * 100_000 + bucket.astype(np.int64)
        cells, inverse = np.unique(key, return_inverse=True)
        total = np.bincount(inverse, weights=weight, minlength=cells.size)
        mean_row = np.bincount(inverse, weights=weight * rows, minlength=cells.size) / total
        mean_shift = np.bincount(inverse, weights=weight * shifts, minlength=cells.size) / total
        p50, p99 = self._dense.mixture_quantiles(np.rint(mean_row).astype(np.intp), mean_shift, total, (0.5, 0.99))
        return p50, p99
