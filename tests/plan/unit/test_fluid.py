"""The fluid fleet model on a synthetic latency table: an M/M/1-like replica of 100 req/s capacity whose
latency at utilization u is 10 ms plus an exponential of mean 10 ms / (1 - u)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servewell_plan import traces
from servewell_plan.fluid import balancer_shares, simulate_fluid
from servewell_plan.model import (
    AutoscalerSpec,
    BalancerPolicy,
    FleetSpec,
    LatencyTable,
    ReplicaModel,
    ScalingPolicy,
    ScalingRules,
    ScalingSignal,
)

UTILIZATIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
QUANTILES = (*(i / 100 for i in range(1, 100)), 0.995, 0.999)
CAPACITY = 100.0


def latency_at(u: float, p: float) -> float:
    return 0.01 - math.log(1 - p) * 0.01 / (1 - u)


TABLE = LatencyTable(
    CAPACITY,
    UTILIZATIONS,
    QUANTILES,
    tuple(tuple(latency_at(u, p) for p in QUANTILES) for u in UTILIZATIONS),
    tuple(0.0 for _ in UTILIZATIONS),
)
REPLICA = ReplicaModel(front_s=0.001, alpha_s=0.005, beta_s=0.001, max_batch_size=8, max_queue=256, cold_start_s=20.0)


def test_steady_load_below_capacity_is_answered_at_the_tables_latency():
    result = simulate_fluid(FleetSpec(REPLICA, 4), traces.steady(200.0, 600.0), TABLE, slo_s=0.1, bin_s=300.0)
    assert result.arrivals == pytest.approx(120_000)
    assert result.ok == pytest.approx(result.arrivals)
    assert result.rejected == pytest.approx(0.0, abs=1e-6)
    assert result.failed == 0.0
    assert result.replica_seconds == pytest.approx(4 * 600.0)
    assert result.replica_hours == pytest.approx(4 * 600.0 / 3600)
    # utilization 0.5: p50 = 10 ms + ln 2 x 20 ms, p99 = 10 ms + ln 100 x 20 ms, P(<= 100 ms) = 1 - e^-4.5
    for stats in result.bins:
        assert stats.p50_s == pytest.approx(latency_at(0.5, 0.5), rel=0.01)
        assert stats.p99_s == pytest.approx(latency_at(0.5, 0.99), rel=0.01)
        assert (stats.replicas_ready, stats.replicas_total) == (4.0, 4.0)
    assert result.slo_attainment == pytest.approx(1 - math.exp(-4.5), abs=0.002)


def test_the_balancers_latency_adds_to_every_request():
    fleet = FleetSpec(REPLICA, 4, balancer_s=0.005)
    result = simulate_fluid(fleet, traces.steady(200.0, 300.0), TABLE, slo_s=0.1, bin_s=300.0)
    assert result.bins[0].p50_s == pytest.approx(latency_at(0.5, 0.5) + 0.005, rel=0.01)


def test_overload_builds_a_backlog_then_refuses_what_overflows():
    result = simulate_fluid(FleetSpec(REPLICA, 2), traces.steady(300.0, 120.0), TABLE, slo_s=0.1, bin_s=10.0)
    # 100 req/s beyond the 200 the two replicas serve; each holds at most 256 waiting.
    assert result.rejected == pytest.approx(100.0 * 120 - 2 * 256, rel=0.01)
    assert result.ok + result.rejected == pytest.approx(result.arrivals)
    depths = [b.queue_depth for b in result.bins]
    assert depths[0] < depths[1] and depths[-1] >= 256
    # A full queue of 256 at 100 req/s is a 2.56 s wait ahead of the table's latency.
    assert result.bins[-1].p50_s > 2.5
    assert result.bins[-1].within_slo == 0


def test_no_ready_replica_refuses_everything():
    result = simulate_fluid(FleetSpec(REPLICA, 0), traces.steady(50.0, 10.0), TABLE, slo_s=0.1, bin_s=10.0)
    assert result.rejected == pytest.approx(500.0)
    assert result.bins[0].p50_s is None


def test_least_connections_fills_the_emptiest_replicas_first():
    backlog = np.array([0.0, 1.0, 5.0])
    pods = np.array([2.0, 1.0, 1.0])
    shares = balancer_shares(BalancerPolicy.LEAST_CONNECTIONS, backlog, pods, 10.0)
    assert shares @ pods == pytest.approx(10.0)
    assert shares == pytest.approx([11 / 3, 8 / 3, 0.0])  # everyone below 5 levels up to 11/3
    assert balancer_shares(BalancerPolicy.ROUND_ROBIN, backlog, pods, 10.0) == pytest.approx([2.5] * 3)


def test_power_of_two_gives_by_rank_and_still_feeds_the_busiest():
    backlog = np.array([0.0, 1.0, 5.0])
    pods = np.array([2.0, 1.0, 1.0])
    shares = balancer_shares(BalancerPolicy.POWER_OF_TWO, backlog, pods, 16.0)
    # Ranks 0-1 (tied) get (7 + 5) / 16 between them, rank 2 gets 3 / 16, rank 3 gets 1 / 16.
    assert shares == pytest.approx([6.0, 3.0, 1.0])


def flash_fleet(signal: ScalingSignal, target: float) -> FleetSpec:
    autoscaler = AutoscalerSpec(
        signal,
        target,
        min_replicas=2,
        max_replicas=40,
        scale_up=ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0)), "Max"),
    )
    return FleetSpec(REPLICA, 2, autoscaler=autoscaler, pod_start_s=10.0)  # ready 30 s after creation


def test_a_flash_crowd_scales_up_after_the_sync_and_start_delays():
    trace = traces.flash_crowd(100.0, factor=5.0, ramp_s=30.0, hold_s=600.0, before_s=300.0, after_s=60.0)
    result = simulate_fluid(flash_fleet(ScalingSignal.QUEUE_DEPTH, 2.0), trace, TABLE, slo_s=0.3, bin_s=15.0)
    by_start = {b.start_s: b for b in result.bins}
    # Nothing is ready before the crowd starts (300 s) + a sync (<= 15 s) + the start delay (30 s).
    assert all(by_start[t].replicas_ready == 2.0 for t in np.arange(0.0, 330.0, 15.0))
    assert by_start[315.0].replicas_total > 2.0  # created at the first sync into the ramp
    peak_ready = max(b.replicas_ready for b in result.bins)
    assert peak_ready >= 6  # 500 req/s needs 5 replicas at full load
    ramp = [b for b in result.bins if 300 <= b.start_s < 420]
    settled = [b for b in result.bins if 780 <= b.start_s < 900]
    share = lambda bins: sum(b.within_slo for b in bins) / sum(b.arrivals for b in bins)  # noqa: E731
    assert share(ramp) < share(settled) - 0.05
    assert share(settled) > 0.9


def test_a_lost_zone_takes_its_third_and_comes_back_after_the_start_delay():
    trace = traces.with_faults(traces.steady(450.0, 300.0), traces.zone_lost(100.0), traces.zone_lost(200.0))
    fleet = FleetSpec(REPLICA, 9, zones=3, pod_start_s=10.0)  # ready 30 s after creation
    result = simulate_fluid(fleet, trace, TABLE, slo_s=0.1, bin_s=10.0)
    by_start = {b.start_s: b for b in result.bins}
    assert by_start[90.0].replicas_ready == 9.0
    assert by_start[100.0].replicas_ready == 6.0
    assert by_start[100.0].replicas_total == 9.0  # 3 replacements starting
    assert by_start[120.0].replicas_ready == 6.0
    assert by_start[130.0].replicas_ready == 9.0
    assert by_start[100.0].failed > 0
    # The replacements went to the other zones: losing zone 0 again costs nothing.
    assert by_start[200.0].replicas_ready == 9.0 and by_start[200.0].failed == 0
    assert result.ok + result.rejected + result.failed == pytest.approx(result.arrivals)


def test_a_lost_replica_fails_its_requests_and_is_replaced():
    trace = traces.with_faults(traces.steady(200.0, 120.0), traces.replica_lost(50.0))
    result = simulate_fluid(FleetSpec(REPLICA, 4, pod_start_s=10.0), trace, TABLE, slo_s=0.1, bin_s=10.0)
    by_start = {b.start_s: b for b in result.bins}
    assert by_start[50.0].replicas_ready == 3.0 and by_start[80.0].replicas_ready == 4.0
    # In flight at 50 req/s and ~30 ms each: about 1.5 requests.
    assert 0.5 < result.failed < 5


def test_an_idle_fleet_scales_down_to_its_minimum_after_the_window():
    autoscaler = AutoscalerSpec(ScalingSignal.CPU, 0.5, min_replicas=2, max_replicas=10)
    fleet = FleetSpec(REPLICA, 8, autoscaler=autoscaler)
    result = simulate_fluid(fleet, traces.steady(20.0, 600.0), TABLE, slo_s=0.1, bin_s=60.0)
    assert result.bins[0].replicas_total == 8.0
    assert result.bins[-1].replicas_total == 2.0
    assert 2 * 600 < result.replica_seconds < 8 * 400


def test_runs_are_deterministic_for_a_seed():
    trace = traces.with_faults(
        traces.diurnal(2000.0, duration_s=3600.0, step_s=10.0, bursts_per_day=48), traces.replica_lost(600.0)
    )
    fleet = FleetSpec(
        REPLICA,
        10,
        balancer=BalancerPolicy.POWER_OF_TWO,
        zones=2,
        autoscaler=AutoscalerSpec(
            ScalingSignal.QUEUE_WAIT, 0.02, min_replicas=2, max_replicas=40, metric_window_s=60.0
        ),
    )
    first = simulate_fluid(fleet, trace, TABLE, slo_s=0.1, seed=3)
    second = simulate_fluid(fleet, trace, TABLE, slo_s=0.1, seed=3)
    assert first == second
    assert first.ok + first.rejected + first.failed == pytest.approx(first.arrivals)
