"""A run is a pure function of its inputs and seed, and its bins add up to its requests."""

from __future__ import annotations

import numpy as np
import pytest

from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import (
    AutoscalerSpec,
    BalancerPolicy,
    Fault,
    FaultKind,
    FleetSpec,
    ReplicaModel,
    ScalingSignal,
    Trace,
)

REPLICA = ReplicaModel(
    front_s=0.002,
    alpha_s=0.004,
    beta_s=0.002,
    max_batch_size=4,
    max_wait_s=0.003,
    jitter_cv=0.4,
    max_queue=64,
    cold_start_s=2.0,
)
# Every source of randomness at once: arrivals, urgent lane, jitter, power-of-two, a seeded fault.
FLEET = FleetSpec(
    REPLICA,
    4,
    balancer=BalancerPolicy.POWER_OF_TWO,
    zones=2,
    pod_start_s=1.0,
    autoscaler=AutoscalerSpec(ScalingSignal.QUEUE_WAIT, 0.01, min_replicas=2, max_replicas=6, sync_s=5.0),
)
TRACE = Trace(10.0, (300.0, 900.0, 400.0), faults=(Fault(12.0, FaultKind.REPLICA_LOST),), urgent_share=0.1)


def test_same_seed_same_run_and_another_seed_another():
    first = simulate(FLEET, OpenLoad(TRACE), seed=7, bin_s=5.0, slo_s=0.05)
    again = simulate(FLEET, OpenLoad(TRACE), seed=7, bin_s=5.0, slo_s=0.05)
    other = simulate(FLEET, OpenLoad(TRACE), seed=8, bin_s=5.0, slo_s=0.05)
    for name in ("arrival_s", "latency_s", "status"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert first.bins == again.bins and first.replica_seconds == again.replica_seconds
    assert first.arrival_s.size != other.arrival_s.size or not np.array_equal(first.arrival_s, other.arrival_s)
    assert (first.status == 2).any()  # the fault did fail requests


def test_shared_node_runs_are_deterministic_too():
    fleet = FleetSpec(REPLICA, 3, node_cores=2.0, client_cpu_s=0.001, balancer=BalancerPolicy.LEAST_CONNECTIONS)
    runs = [simulate(fleet, ClosedLoad(12, 5.0), seed=1) for _ in range(2)]
    np.testing.assert_array_equal(runs[0].latency_s, runs[1].latency_s)


def test_bins_add_up_to_the_requests():
    result = simulate(FLEET, OpenLoad(TRACE), seed=7, bin_s=7.0, slo_s=0.05)
    assert len(result.bins) == 5  # 30 s in bins of 7 s: the last covers 28-30 s
    assert [b.start_s for b in result.bins] == [0.0, 7.0, 14.0, 21.0, 28.0]
    for field in ("arrivals", "ok", "rejected", "failed"):
        assert sum(getattr(b, field) for b in result.bins) == getattr(result.window(0.0, 30.0), field)
    assert sum(b.within_slo for b in result.bins) == result.window(0.0, 30.0).within_slo
    answered = result.latency_s[result.status == 0]
    assert result.window(0.0, 30.0).within_slo == int(np.sum(answered <= 0.05))
    assert result.replica_seconds == pytest.approx(
        sum(b.replicas_total * 7.0 for b in result.bins[:-1]) + result.bins[-1].replicas_total * 2.0
    )


def test_a_window_counts_requests_by_arrival():
    result = simulate(FleetSpec(REPLICA, 1), OpenLoad(Trace(10.0, (50.0,))), seed=3)
    inside = (result.arrival_s >= 2.0) & (result.arrival_s < 6.0)
    stats = result.window(2.0, 6.0)
    assert stats.arrivals == int(inside.sum())
    assert stats.throughput_rps == pytest.approx(stats.ok / 4.0)
    assert stats.p50_s == pytest.approx(float(np.median(result.latency_s[inside & (result.status == 0)])))
    assert stats.within_slo is None  # the run had no SLO
    empty = result.window(20.0, 30.0)
    assert empty.arrivals == 0 and empty.p99_s is None and empty.throughput_rps == 0.0
