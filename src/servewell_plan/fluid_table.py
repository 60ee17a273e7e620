"""The latency table made dense for the fluid fleet model: one replica's latency distribution, refusal
share and mean queueing at any utilization, looked up by index instead of interpolated per request.

Approximations (stated in the docs):
- Utilization is resolved to 1/1000 (nearest dense row). Between the table's rows the latency
  quantiles are interpolated linearly in utilization; below the first row the first row holds, above
  the last row (0.98 as `latency_table` builds it) the last row holds.
- A row's CDF is the table's quantile function inverted with linear interpolation between quantile
  points, 0 below its lowest quantile (p1) and 1 above its highest (p99.9): the first and last
  fractions of a percent are squeezed onto those points.
- CDFs are tabulated on a log-spaced latency grid (1,024 points from half the fastest p1 to the
  slowest p99.9, under 1 % apart for a 1,000x range) and read with linear interpolation.
"""

from __future__ import annotations

import math

import numpy as np

from servewell_plan.model import LatencyTable

#: Dense utilization rows: index = round(utilization x RHO_STEPS).
RHO_STEPS = 1000
#: Points of the log-spaced latency grid of each row's CDF.
CDF_POINTS = 1024
#: Points of the absolute latency grid a bin's mixture is evaluated on.
MIXTURE_POINTS = 2048


class DenseLatency:
    """Lookups over one LatencyTable at RHO_STEPS + 1 utilizations."""

    def __init__(self, table: LatencyTable) -> None:
        utilizations = np.asarray(table.utilizations, dtype=float)
        quantiles = np.asarray(table.quantiles, dtype=float)
        latency = np.asarray(table.latency_s, dtype=float)
        if table.capacity_rps <= 0 or utilizations.size == 0 or latency.shape != (utilizations.size, quantiles.size):
            raise ValueError("the latency table needs capacity > 0 and one row of quantiles per utilization")
        if np.any(np.diff(utilizations) <= 0) or np.any(np.diff(quantiles) <= 0):
            raise ValueError("the latency table's utilizations and quantiles must increase")
        # Sampling noise can make a measured quantile row dip; a quantile function cannot.
        latency = np.maximum.accumulate(np.maximum(latency, 0.0), axis=1)
        self.capacity_rps = table.capacity_rps
        rho = np.linspace(0.0, 1.0, RHO_STEPS + 1)
        self.quantiles = quantiles
        self.latency = np.stack([np.interp(rho, utilizations, latency[:, j]) for j in range(quantiles.size)], axis=1)
        self.rejected = np.interp(rho, utilizations, np.asarray(table.rejected_share, dtype=float))
        # Mean latency: the integral of the quantile function, its ends held flat to p=0 and p=1.
        p = np.concatenate(([0.0], quantiles, [1.0]))
        ends = np.concatenate((self.latency[:, :1], self.latency, self.latency[:, -1:]), axis=1)
        self.mean = np.sum((ends[:, 1:] + ends[:, :-1]) / 2 * np.diff(p), axis=1)
        #: Mean time a request spends beyond the lightest load's latency: its queueing at this load.
        self.excess_mean = np.maximum(self.mean - self.mean[0], 0.0)
        positive = self.latency[self.latency > 0]
        self.y0 = float(positive.min()) / 2 if positive.size else 1e-6
        self.y1 = max(float(self.latency.max()), self.y0 * 1.01)
        self._log_y0 = math.log(self.y0)
        self._dlog = (math.log(self.y1) - self._log_y0) / (CDF_POINTS - 1)
        grid = np.exp(self._log_y0 + self._dlog * np.arange(CDF_POINTS))
        self.cdf_table = np.stack([np.interp(grid, row, quantiles, left=0.0, right=1.0) for row in self.latency])
        self.cdf_table[:, -1] = 1.0
        self._flat = self.cdf_table.ravel()

    @staticmethod
    def rho_index(rho: np.ndarray) -> np.ndarray:
        """The dense row of each utilization (clipped to [0, 1])."""
        return np.rint(np.clip(rho, 0.0, 1.0) * RHO_STEPS).astype(np.intp)

    def cdf(self, k: np.ndarray, y: np.ndarray) -> np.ndarray:
        """P(latency <= y) at dense rows `k` (arrays of one shape, or broadcastable)."""
        pos = (np.log(np.maximum(y, self.y0)) - self._log_y0) / self._dlog
        pos = np.clip(pos, 0.0, CDF_POINTS - 1.000001)
        j = pos.astype(np.intp)
        frac = pos - j
        at = np.asarray(k, dtype=np.intp) * CDF_POINTS + j
        value = self._flat[at] * (1 - frac) + self._flat[at + 1] * frac
        return np.where(y < self.y0, 0.0, value)

    def mixture_quantiles(
        self, k: np.ndarray, shift_s: np.ndarray, weight: np.ndarray, probabilities: tuple[float, ...]
    ) -> list[float]:
        """Quantiles of a mixture: component c is row `k[c]` delayed by `shift_s[c]`, with `weight[c]`.

        The mixture CDF is evaluated on a log-spaced grid spanning every component and inverted by
        linear interpolation.
        """
        total = float(weight.sum())
        low = self.y0 + float(shift_s.min())
        high = self.y1 + float(shift_s.max())
        grid = np.exp(np.linspace(math.log(low), math.log(high * 1.0001), MIXTURE_POINTS))
        values = self.cdf(k[:, None], grid[None, :] - shift_s[:, None])
        mixture = np.maximum.accumulate((weight[:, None] * values).sum(axis=0) / total)
        return [float(np.interp(p, mixture, grid)) for p in probabilities]
