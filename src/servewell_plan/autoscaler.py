"""The HorizontalPodAutoscaler controller as Kubernetes runs it, one sync at a time, for the
simulators: the raw recommendation from the metric (`replica_calculator.go`), then the `behavior`
(`horizontal.go`: stabilization window, then the scaling policies, then min/max).

Pure and clock-free: the simulator passes the time and what the pods report; the controller
answers the Deployment's new `spec.replicas`. Quotes are from the Kubernetes documentation
("Horizontal Pod Autoscaling", algorithm details and configurable scaling behavior) and the
controller's source, which the docs defer to for the details.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servewell_plan.model import AutoscalerSpec, ScalingRules, ScalingSample, ScalingSignal

#: Float noise guard before a ceil: the HPA computes in integer milli-units, where 0.7 / 0.7 x 4 is
#: exactly 4; in floats it can come out as 4.000000000000001 and ceil to 5.
_CEIL_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class _Recommendation:
    """One raw (unstabilized) recommendation, as the HPA keeps them per autoscaler."""

    at_s: float
    replicas: int


@dataclass(frozen=True, slots=True)
class _ScaleEvent:
    """One change of spec.replicas the controller made (`timestampedScaleEvent`)."""

    at_s: float
    change: int  # pods added (scale-up events) or removed (scale-down events), > 0


def _ceil(value: float) -> int:
    return math.ceil(value - _CEIL_SLACK)


def per_pod_recommendation(
    current: int, values: tuple[float, ...], unready_pods: int, target: float, tolerance: float
) -> int:
    """Desired replicas for a per-pod average (Resource utilization, or a Pods metric's AverageValue).

    "desiredReplicas = ceil[currentReplicas * ( currentMetricValue / desiredMetricValue )]" where the
    current value is the mean over the ready pods that report it; the count multiplied is the number
    of pods counted (the ready ones, plus the unready ones when they are folded in below).
    """
    if not values:
        # "If there were any missing metrics ... " -- with none at all the controller cannot compute a
        # recommendation and does not scale (FailedGetResourceMetric).
        return current
    ready = len(values)
    total = float(sum(values))
    ratio = total / (target * ready)
    if unready_pods == 0 or ratio <= 1.0:
        # "If the ratio is sufficiently close to 1.0 (within a globally-configurable tolerance, 0.1 by
        # default), the control plane skips any scaling action."
        if abs(ratio - 1.0) <= tolerance:
            return current
        return _ceil(ratio * ready)
    # "If there were any not-yet-ready pods, and the workload would have scaled up without factoring
    # in missing metrics or not-yet-ready pods, the controller conservatively assumes that the
    # not-yet-ready pods are consuming 0% of the desired metric, further dampening the magnitude of a
    # scale up." (The controller applies this to every metric type it averages over pods; for Pods
    # metrics its "unready" group is the Pending pods, for CPU the not-ready or still-initializing
    # ones: we count every created pod that is not ready yet.)
    counted = ready + unready_pods
    new_ratio = total / (target * counted)
    # "If the new ratio reverses the scale direction, or is within the tolerance, the controller
    # doesn't take any scaling action."
    if abs(new_ratio - 1.0) <= tolerance or new_ratio < 1.0:
        return current
    desired = _ceil(new_ratio * counted)
    # replica_calculator.go: a scale-up ratio that would still shrink the workload keeps it as is.
    return current if desired < current else desired


def external_value_recommendation(current: int, ready_pods: int, value: float, target: float, tolerance: float) -> int:
    """Desired replicas for an External metric with a `Value` target (KEDA's `metricType: Value`).

    The HPA compares the one fleet-wide value with the target and scales the *ready* pod count:
    `getUsageRatioReplicaCount` returns `ceil(usageRatio * readyPodCount)`, after the same
    tolerance check; with spec.replicas at 0 it answers `ceil(usageRatio)` (scale from zero).
    """
    ratio = value / target
    if current == 0:
        return _ceil(ratio)
    if abs(ratio - 1.0) <= tolerance:
        return current
    return _ceil(ratio * ready_pods)


class HorizontalAutoscaler:
    """One HPA (or the HPA KEDA creates for a ScaledObject) driving one Deployment.

    Call `sync` every `spec.sync_s` (`--horizontal-pod-autoscaler-sync-period`, 15 s by default; KEDA
    feeds the same loop from Prometheus). The controller keeps what the real one keeps between
    syncs: its recent raw recommendations (for the stabilization windows) and its recent scale
    events (for the policies' periods).
    """

    def __init__(self, spec: AutoscalerSpec, initial_replicas: int) -> None:
        if spec.target <= 0:
            raise ValueError(f"the autoscaler target must be > 0, got {spec.target}")
        if not 0 <= spec.min_replicas <= spec.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {spec.min_replicas}, {spec.max_replicas}")
        for rules in (spec.scale_up, spec.scale_down):
            if rules.select not in ("Max", "Min", "Disabled"):
                raise ValueError(f"selectPolicy must be Max, Min or Disabled, got {rules.select!r}")
            for policy in rules.policies:
                if policy.kind not in ("Pods", "Percent") or policy.value <= 0 or policy.period_s <= 0:
                    raise ValueError(
                        f"a scaling policy needs type Pods or Percent, value > 0 and periodSeconds > 0: {policy}"
                    )
        self._spec = spec
        self._replicas = initial_replicas
        self._recommendations: list[_Recommendation] = []
        self._started = False
        self._up_events: list[_ScaleEvent] = []
        self._down_events: list[_ScaleEvent] = []
        periods = [p.period_s for rules in (spec.scale_up, spec.scale_down) for p in rules.policies]
        self._longest_period_s = max(periods, default=0.0)
        self._longest_window_s = max(spec.scale_up.stabilization_s, spec.scale_down.stabilization_s)

    @property
    def replicas(self) -> int:
        """spec.replicas as this controller last set it (or the initial count before any sync)."""
        return self._replicas

    def sync(self, now_s: float, sample: ScalingSample) -> int:
        """The Deployment's new spec.replicas after this sync."""
        spec = self._spec
        current = sample.current_replicas
        if not self._started:
            # The simulated fleet starts in a steady state: as if the controller had been
            # recommending the initial size up to the first sync (a freshly created HPA has no
            # history and could scale down at once; a running one would not).
            self._started = True
            self._recommendations.append(_Recommendation(now_s, self._replicas))
        if current == 0 and spec.min_replicas != 0:
            # horizontal.go: spec.replicas 0 with minReplicas > 0 means autoscaling is disabled.
            desired = 0
        elif current > spec.max_replicas:
            # horizontal.go: out of [minReplicas, maxReplicas] the controller goes straight to the
            # bound, without a recommendation, stabilization or policies.
            desired = spec.max_replicas
        elif current < spec.min_replicas:
            desired = spec.min_replicas
        else:
            raw = self.recommend(sample)
            stabilized = self._stabilize(now_s, current, raw)
            desired = self._limit_rate(now_s, current, stabilized)
        if desired != current:
            self._store_event(now_s, desired - current)
        self._replicas = desired
        return desired

    def recommend(self, sample: ScalingSample) -> int:
        """The raw recommendation from the metric alone (before behavior and min/max)."""
        spec = self._spec
        current = sample.current_replicas
        if spec.signal is ScalingSignal.QUEUE_WAIT:
            if sample.fleet_value is None:
                return current  # the query returned nothing: the HPA keeps the size
            # The ready pod count: one value per ready pod when the caller gives them (they are not
            # read), else spec.replicas less the pods not ready yet.
            ready = len(sample.ready_values) if sample.ready_values else max(0, current - sample.unready_pods)
            return external_value_recommendation(current, ready, sample.fleet_value, spec.target, spec.tolerance)
        return per_pod_recommendation(current, sample.ready_values, sample.unready_pods, spec.target, spec.tolerance)

    def _stabilize(self, now_s: float, current: int, raw: int) -> int:
        """`stabilizeRecommendationWithBehaviors`: "the highest recommendation within the scale-down
        window" bounds a scale-down, the lowest within the scale-up window bounds a scale-up; the
        result is the current size brought within [up bound, down bound]."""
        up_cutoff = now_s - self._spec.scale_up.stabilization_s
        down_cutoff = now_s - self._spec.scale_down.stabilization_s
        up_bound = raw
        down_bound = raw
        for rec in self._recommendations:
            # The controller's windows are open at the old end (timestamp.After(cutoff)).
            if rec.at_s > up_cutoff:
                up_bound = min(up_bound, rec.replicas)
            if rec.at_s > down_cutoff:
                down_bound = max(down_bound, rec.replicas)
        stabilized = current
        if stabilized < up_bound:
            stabilized = up_bound
        if stabilized > down_bound:
            stabilized = down_bound
        # Keep what either window can still see; the raw recommendation is recorded, not the
        # stabilized one.
        keep_after = now_s - self._longest_window_s
        self._recommendations = [r for r in self._recommendations if r.at_s >= keep_after]
        self._recommendations.append(_Recommendation(now_s, raw))
        return stabilized

    def _limit_rate(self, now_s: float, current: int, desired: int) -> int:
        """`convertDesiredReplicasWithBehaviorRate`: the policies' limit, then min/max."""
        spec = self._spec
        if desired > current:
            limit = max(self._scale_up_limit(now_s, current, spec.scale_up), current)
            return min(desired, spec.max_replicas, limit)
        if desired < current:
            limit = min(self._scale_down_limit(now_s, current, spec.scale_down), current)
            return max(desired, spec.min_replicas, limit)
        return desired

    def _period_start(self, now_s: float, current: int, period_s: float) -> int:
        """The replica count at the start of a policy's period: "the number of replicas period_s
        ago", i.e. now less what was added plus what was removed within the period
        (`periodStartReplicas := currentReplicas - replicasAdded + replicasDeleted`)."""
        cutoff = now_s - period_s
        added = sum(e.change for e in self._up_events if e.at_s > cutoff)
        removed = sum(e.change for e in self._down_events if e.at_s > cutoff)
        return current - added + removed

    def _scale_up_limit(self, now_s: float, current: int, rules: ScalingRules) -> int:
        """The most replicas the scale-up policies allow now. "selectPolicy: Max" picks the policy
        allowing the highest change, "Min" the lowest, "Disabled" turns scaling up off."""
        if rules.select == "Disabled" or not rules.policies:
            return current
        proposals = []
        for policy in rules.policies:
            start = self._period_start(now_s, current, policy.period_s)
            if policy.kind == "Pods":
                proposals.append(start + policy.value)
            else:
                # "the proposal has to be rounded up because the proposed change might not increase
                # the replica count causing the target to never scale up"
                proposals.append(math.ceil(start * (1 + policy.value / 100)))
        return min(proposals) if rules.select == "Min" else max(proposals)

    def _scale_down_limit(self, now_s: float, current: int, rules: ScalingRules) -> int:
        """The fewest replicas the scale-down policies allow now (Max: the biggest removal)."""
        if rules.select == "Disabled" or not rules.policies:
            return current
        proposals = []
        for policy in rules.policies:
            start = self._period_start(now_s, current, policy.period_s)
            if policy.kind == "Pods":
                proposals.append(start - policy.value)
            else:
                # Truncated, as the controller's int32 conversion does: the count removed rounds up
                # (the docs' example: 10 % of 72 pods removes 8).
                proposals.append(int(start * (1 - policy.value / 100)))
        return max(proposals) if rules.select == "Min" else min(proposals)

    def _store_event(self, now_s: float, change: int) -> None:
        # storeScaleEvent: events older than the longest policy period are never read again.
        keep_after = now_s - self._longest_period_s
        self._up_events = [e for e in self._up_events if e.at_s >= keep_after]
        self._down_events = [e for e in self._down_events if e.at_s >= keep_after]
        if change > 0:
            self._up_events.append(_ScaleEvent(now_s, change))
        else:
            self._down_events.append(_ScaleEvent(now_s, -change))
