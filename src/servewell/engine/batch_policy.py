"""When to start a batch: the `idle`, `window` and `adaptive` policies, pure and clock-free.

A policy is asked only when an instance is free and a normal-lane batch could start; it
answers "now" (None) or the time to wait until. The highest lane never asks: it never waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

#: Share of the latency target the adaptive policy plans for; the rest absorbs tail variance.
SLO_HEADROOM = 0.8


@dataclass(slots=True, frozen=True)
class BatchOpportunity:
    """What the scheduler knows when an instance is free."""

    now: float
    oldest_enqueued_at: float
    ready_rows: int
    max_rows: int
    instances: int


class BatchLatencyModel:
    """Online fit of batch latency L(b) = a + c*b by exponentially weighted least squares.

    The weight decays per observation, so the curve follows the model as load, threads or
    the machine change; until two batch sizes are seen it assumes latency grows linearly.
    """

    def __init__(self, decay: float = 0.98) -> None:
        self._decay = decay
        self._w = self._sb = self._sbb = self._sl = self._sbl = 0.0
        self._fit: tuple[float, float] | None = None  # the coefficients, until the next observation

    def observe(self, rows: int, seconds: float) -> None:
        """Record that a batch of `rows` took `seconds`."""
        self._fit = None
        d = self._decay
        self._w = d * self._w + 1.0
        self._sb = d * self._sb + rows
        self._sbb = d * self._sbb + rows * rows
        self._sl = d * self._sl + seconds
        self._sbl = d * self._sbl + rows * seconds

    @property
    def observed(self) -> bool:
        """Whether any batch has been seen."""
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(fixed cost a, per-row cost c), both >= 0, in seconds (computed once per observation:
        every request's deadline check asks)."""
        if self._fit is None:
            self._fit = self._coefficients()
        return self._fit

    def _coefficients(self) -> tuple[float, float]:
        if self._w == 0:
            return 0.0, 0.0
        mean_b = self._sb / self._w
        mean_l = self._sl / self._w
        var_b = self._sbb / self._w - mean_b * mean_b
        if var_b < 1e-9:
            # One batch size seen so far: attribute everything to rows (the cautious guess).
            return 0.0, mean_l / max(mean_b, 1.0)
        slope = (self._sbl / self._w - mean_b * mean_l) / var_b
        slope = max(slope, 0.0)
        return max(mean_l - slope * mean_b, 0.0), slope

    def predict(self, rows: int) -> float:
        """Predicted seconds for a batch of `rows`."""
        a, c = self.coefficients()
        return a + c * rows


class ArrivalRate:
    """Requests per second, an exponentially weighted average of inter-arrival gaps."""

    def __init__(self, alpha: float = 0.05) -> None:
        self._alpha = alpha
        self._last: float | None = None
        self._gap: float | None = None

    def observe(self, now: float) -> None:
        """Record an arrival at `now`."""
        if self._last is not None:
            gap = max(now - self._last, 1e-6)
            self._gap = gap if self._gap is None else (1 - self._alpha) * self._gap + self._alpha * gap
        self._last = now

    def per_second(self, now: float) -> float:
        """Current rate; decays when arrivals stop (the silence so far counts as a gap)."""
        if self._gap is None or self._last is None:
            return 0.0
        gap = max(self._gap, (now - self._last) * 0.5)
        return 1.0 / gap


def idle_wait(_: BatchOpportunity) -> float | None:
    """idle: start at once; batches grow only while every instance is busy."""
    return None


def window_wait(op: BatchOpportunity, max_wait_s: float) -> float | None:
    """window: wait until the batch is full or the oldest request has waited `max_wait_s`."""
    if op.ready_rows >= op.max_rows:
        return None
    until = op.oldest_enqueued_at + max_wait_s
    return until if until > op.now else None


def adaptive_wait(
    op: BatchOpportunity, latency: BatchLatencyModel, arrivals: ArrivalRate, slo_s: float, max_wait_s: float
) -> float | None:
    """adaptive: wait only for the batch size that keeps up with the arrival rate, and only as
    long as the oldest request can still finish within the latency target.

    The batch size needed is the smallest b with b / L(b) >= rate / instances: below it the
    instances cannot keep up and queues grow; above it waiting only adds latency. At low load
    that size is 1, so the policy behaves like `idle`.
    """
    if op.ready_rows >= op.max_rows or not latency.observed:
        return None
    rate = arrivals.per_second(op.now)
    if rate <= 0:
        return None
    per_instance = rate / max(op.instances, 1)
    a, c = latency.coefficients()
    # b / (a + c b) >= r  <=>  b (1 - r c) >= r a
    if per_instance * c >= 1.0:
        needed = op.max_rows  # even the largest batch barely keeps up: make it as large as allowed
    else:
        needed = min(op.max_rows, max(1, math.ceil(per_instance * a / (1.0 - per_instance * c))))
    if op.ready_rows >= needed:
        return None
    # Time for the missing rows to arrive, capped by the SLO slack of the oldest request.
    fill_s = (needed - op.ready_rows) / rate
    slack_s = op.oldest_enqueued_at + SLO_HEADROOM * slo_s - latency.predict(needed) - op.now
    wait_s = min(fill_s, slack_s, max_wait_s - (op.now - op.oldest_enqueued_at))
    return op.now + wait_s if wait_s > 0 else None


@dataclass(slots=True, frozen=True)
class PolicyLimits:
    """The batching settings a policy reads (from the model's live batching config)."""

    max_wait_s: float
    latency_slo_s: float


@dataclass(slots=True)
class LearnedLoad:
    """What the scheduler has learned online: batch latency by size and the arrival rate."""

    latency: BatchLatencyModel = field(default_factory=BatchLatencyModel)
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)


#: A policy: when a batch should start (None: now), given the opportunity, limits and learned load.
BatchPolicy = Callable[[BatchOpportunity, PolicyLimits, LearnedLoad], "float | None"]


def _idle(op: BatchOpportunity, _limits: PolicyLimits, _learned: LearnedLoad) -> float | None:
    return idle_wait(op)


def _window(op: BatchOpportunity, limits: PolicyLimits, _learned: LearnedLoad) -> float | None:
    return window_wait(op, limits.max_wait_s)


def _adaptive(op: BatchOpportunity, limits: PolicyLimits, learned: LearnedLoad) -> float | None:
    return adaptive_wait(op, learned.latency, learned.arrivals, limits.latency_slo_s, limits.max_wait_s)


#: Every policy by the name model.yaml uses (`batching.policy`).
POLICIES: dict[str, BatchPolicy] = {"idle": _idle, "window": _window, "adaptive": _adaptive}
