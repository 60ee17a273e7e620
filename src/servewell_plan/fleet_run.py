"""Run a planned fleet through a trace under each autoscaling policy: the request-level simulator
when the trace is small enough to simulate request by request, the fluid model past that.

The autoscalers are configured as the Kustomize components ship them (`deploy/kubernetes/
components/hpa` and `keda`): up fast (100 % or 2 pods per 30 s, no stabilization), down slowly
(a 300 s window, 25 % per 60 s), with the plan's targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewell_plan.des import OpenLoad, simulate
from servewell_plan.fluid import simulate_fluid
from servewell_plan.model import (
    AutoscalerSpec,
    BalancerPolicy,
    BinStats,
    FleetSpec,
    ScalingPolicy,
    ScalingRules,
    ScalingSignal,
    Trace,
)
from servewell_plan.sizing import Plan

#: Above this many expected requests the fluid model runs instead of the request-level one.
MAX_REQUEST_LEVEL = 3_000_000
SHIPPED_SCALE_UP = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 30.0), ScalingPolicy("Pods", 2, 30.0)), "Max")
SHIPPED_SCALE_DOWN = ScalingRules(300.0, (ScalingPolicy("Percent", 25, 60.0),), "Min")
#: The policies compared: a fixed fleet sized for the peak, and the three signals.
POLICIES = ("fixed", "cpu", "queue_depth", "queue_wait")


@dataclass(frozen=True, slots=True)
class FleetOutcome:
    """One policy through one trace."""

    policy: str
    balancer: str
    fidelity: str  # "request" or "fluid"
    arrivals: float
    slo_attainment: float
    rejected_share: float
    failed_share: float
    worst_bin_p99_s: float | None
    replica_hours: float
    max_replicas: float
    bins: tuple[BinStats, ...]


def autoscaler_for(plan: Plan, policy: str) -> AutoscalerSpec | None:
    """The shipped autoscaler behaviour with this plan's target for `policy` (None: fixed)."""
    if policy == "fixed":
        return None
    signal = ScalingSignal(policy)
    target = {ScalingSignal.CPU: plan.cpu_target, ScalingSignal.QUEUE_DEPTH: plan.queue_depth_target,
              ScalingSignal.QUEUE_WAIT: plan.queue_wait_target_s}[signal]
    return AutoscalerSpec(signal, target, min_replicas=plan.min_replicas,
                          max_replicas=plan.max_replicas,
                          metric_window_s=60.0 if signal is ScalingSignal.QUEUE_WAIT else 0.0,
                          scale_up=SHIPPED_SCALE_UP, scale_down=SHIPPED_SCALE_DOWN)


def expected_requests(trace: Trace) -> float:
    """How many requests the trace offers."""
    return float(sum(trace.rates_rps)) * trace.step_s


def run_policy(plan: Plan, trace: Trace, policy: str, *, balancer: BalancerPolicy = BalancerPolicy.ROUND_ROBIN,
               zones: int = 1, pod_start_s: float = 10.0, seed: int = 0, fidelity: str = "auto",
               bin_s: float | None = None) -> FleetOutcome:
    """Simulate the plan's fleet through `trace` under `policy`."""
    initial = plan.replicas_with_failover if policy == "fixed" else max(
        plan.min_replicas, int(np.ceil(trace.rates_rps[0] / max(plan.target_rps, 1e-9))))
    fleet = FleetSpec(plan.fit.replica, initial, balancer=balancer, zones=zones,
                      autoscaler=autoscaler_for(plan, policy), pod_start_s=pod_start_s)
    if fidelity == "auto":
        fidelity = "request" if expected_requests(trace) <= MAX_REQUEST_LEVEL else "fluid"
    slo_s = plan.inputs.slo_s
    bin_s = bin_s or max(10.0, trace.duration_s / 288)
    if fidelity == "request":
        result = simulate(fleet, OpenLoad(trace), seed=seed, bin_s=bin_s, slo_s=slo_s)
        bins = tuple(result.bins)
        arrivals = float(result.status.size)
        within = float(np.sum((result.status == 0) & (result.latency_s <= slo_s)))
        rejected = float(np.sum(result.status == 1))
        failed = float(np.sum(result.status == 2))
        replica_seconds = result.replica_seconds
    else:
        fluid = simulate_fluid(fleet, trace, plan.table, slo_s=slo_s, bin_s=bin_s, seed=seed)
        bins = tuple(fluid.bins)
        arrivals, within, rejected, failed = fluid.arrivals, fluid.within_slo, fluid.rejected, fluid.failed
        replica_seconds = fluid.replica_seconds
    p99s = [b.p99_s for b in bins if b.p99_s is not None and b.arrivals > 0]
    return FleetOutcome(
        policy, balancer.value, fidelity, arrivals, within / arrivals if arrivals else 1.0,
        rejected / arrivals if arrivals else 0.0, failed / arrivals if arrivals else 0.0,
        max(p99s) if p99s else None, replica_seconds / 3600, max((b.replicas_total for b in bins), default=0.0), bins)
