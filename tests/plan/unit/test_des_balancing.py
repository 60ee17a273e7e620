"""Overload and load balancing: the bounded batcher queue refuses (and bounds the wait), every request
is accounted for, and balancers that look at the replicas' load beat round robin at the tail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import BalancerPolicy, FleetSpec, ReplicaModel, Trace

SERVICE_S = 0.01


def test_a_full_queue_refuses_and_bounds_the_wait():
    replica = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=SERVICE_S, max_queue=16)
    rate = 3 / SERVICE_S  # three times what the replica serves
    result = simulate(FleetSpec(replica, 1), OpenLoad(Trace(20.0, (rate,))), seed=2)
    refused = result.status == 1
    assert refused.mean() == pytest.approx(2 / 3, abs=0.03)
    assert np.isnan(result.latency_s[refused]).all()
    answered = result.latency_s[result.status == 0]
    # An admitted request has at most max_queue requests ahead of it plus the one being served.
    assert answered.max() <= (16 + 1) * SERVICE_S + 1e-9
    assert answered.max() > 15 * SERVICE_S  # and the queue does fill
    stats = result.window(0.0, 20.0)
    assert stats.arrivals == result.status.size == stats.ok + stats.rejected + stats.failed
    assert stats.throughput_rps == pytest.approx(1 / SERVICE_S, rel=0.02)


def test_every_request_ends_answered_refused_or_failed_even_past_the_end():
    replica = ReplicaModel(front_s=0.001, alpha_s=0.0, beta_s=SERVICE_S, max_queue=1000)
    result = simulate(FleetSpec(replica, 1), OpenLoad(Trace(5.0, (150.0,))), seed=1)
    assert set(np.unique(result.status).tolist()) <= {0, 1, 2}
    assert np.nanmax(result.arrival_s + result.latency_s) > 5.5  # a backlog served after the end
    assert result.arrival_s.max() < 5.0
    assert sum(b.arrivals for b in result.bins) == result.status.size
    assert len(result.bins) == 1 and result.bins[0].ok == result.status.size  # bin_s 10 > 5 s


def test_refused_closed_loop_clients_send_again():
    replica = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=SERVICE_S, max_queue=2, overhead_s=0.005)
    stats = simulate(FleetSpec(replica, 1), ClosedLoad(10, 5.0)).window(0.5, 5.0)
    assert stats.rejected > 0
    assert stats.throughput_rps == pytest.approx(1 / SERVICE_S, rel=0.02)  # refusals do not idle the replica


@pytest.mark.parametrize("policy", [BalancerPolicy.LEAST_CONNECTIONS, BalancerPolicy.POWER_OF_TWO])
def test_load_aware_balancers_cut_the_tail_of_round_robin(policy):
    replica = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=SERVICE_S, jitter_cv=1.0, max_queue=10_000)
    rate = 0.9 * 10 / SERVICE_S
    load = OpenLoad(Trace(20_000 / rate, (rate,)))
    p99 = {}
    for each in (BalancerPolicy.ROUND_ROBIN, policy):
        stats = simulate(FleetSpec(replica, 10, balancer=each), load, seed=0).window(2.0, math.inf)
        assert stats.p99_s is not None
        p99[each] = stats.p99_s
    assert p99[policy] < 0.5 * p99[BalancerPolicy.ROUND_ROBIN]


def test_round_robin_spreads_evenly():
    # Ten replicas at 95 % with fixed service: round robin turns Poisson arrivals into nearly
    # regular ones per replica (an E10/D/1 queue), far below the M/D/1 wait at that load.
    replica = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=SERVICE_S, max_queue=10_000)
    rate = 0.95 * 10 / SERVICE_S
    stats = simulate(FleetSpec(replica, 10), OpenLoad(Trace(10_000 / rate, (rate,)))).window(1.0, math.inf)
    md1_wait = 0.95 * SERVICE_S / (2 * 0.05)
    assert stats.mean_s is not None and stats.mean_s - SERVICE_S < 0.25 * md1_wait
