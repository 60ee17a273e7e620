"""Faults: a lost replica fails what it held and is replaced after the pod's start delay; a lost zone
takes every pod in it, and its replacements start elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import Fault, FaultKind, FleetSpec, ReplicaModel, Trace

REPLICA = ReplicaModel(front_s=0.002, alpha_s=0.0, beta_s=0.01, max_queue=1000, cold_start_s=3.0)
POD_START_S = 2.0


def run(replicas: int, faults: tuple[Fault, ...], *, rate: float = 120.0, zones: int = 1, duration_s: float = 20.0):
    fleet = FleetSpec(REPLICA, replicas, zones=zones, pod_start_s=POD_START_S)
    trace = Trace(duration_s, (rate,), faults=faults)
    return simulate(fleet, OpenLoad(trace), seed=5, bin_s=1.0)


def test_a_lost_replica_fails_what_it_held_and_is_replaced_after_its_start_delay():
    result = run(2, (Fault(5.0, FaultKind.REPLICA_LOST),), rate=150.0)
    failed = result.status == 2
    assert failed.sum() >= 1
    # Only requests in the replica at the fault fail: they arrived before it, and not long before.
    assert result.arrival_s[failed].max() < 5.0
    assert result.arrival_s[failed].min() > 4.0
    ready = [b.replicas_ready for b in result.bins]
    total = [b.replicas_total for b in result.bins]
    assert ready[:5] == [2.0] * 5
    assert ready[5:10] == [1.0] * 5  # the replacement starts for pod_start_s + cold_start_s = 5 s
    assert ready[10:] == [2.0] * 10
    assert total == [2.0] * 20  # the replacement costs from its creation
    assert result.replica_seconds == pytest.approx(40.0)
    # One replica alone at 150 req/s of a 100 req/s replica: the queue grows, then drains.
    assert max(b.p99_s or 0.0 for b in result.bins[5:12]) > 0.2


def test_with_no_ready_replica_requests_are_refused_until_one_is():
    result = run(1, (Fault(5.0, FaultKind.REPLICA_LOST),), rate=50.0)
    refused = result.status == 1
    assert refused.any()
    assert result.arrival_s[refused].min() >= 5.0 and result.arrival_s[refused].max() < 10.0
    assert all(b.rejected == b.arrivals for b in result.bins[5:10])
    assert all(b.rejected == 0 for b in result.bins[10:])


def test_a_lost_zone_takes_its_pods_and_replacements_go_elsewhere():
    # Four pods over two zones: pods 0 and 2 are zone 0's. A second zone loss finds zone 0 empty,
    # which proves the replacements were created in zone 1.
    faults = (Fault(5.0, FaultKind.ZONE_LOST), Fault(12.0, FaultKind.ZONE_LOST))
    result = run(4, faults, rate=200.0, zones=2)
    failed = result.status == 2
    assert failed.any()
    assert result.arrival_s[failed].max() < 5.0  # nothing fails at 12 s
    ready = [b.replicas_ready for b in result.bins]
    assert ready[4] == 4.0 and ready[5:10] == [2.0] * 5 and ready[10:] == [4.0] * 10


def test_a_lost_replica_in_a_closed_loop_sends_its_clients_elsewhere():
    fleet = FleetSpec(REPLICA, 2, pod_start_s=POD_START_S)
    result = simulate(fleet, ClosedLoad(6, 12.0, faults=(Fault(4.0, FaultKind.REPLICA_LOST),)), bin_s=1.0)
    failed = int(np.sum(result.status == 2))
    assert 1 <= failed <= 6
    # One replica serves the six clients while the other starts, then two again.
    assert result.bins[6].ok == pytest.approx(100, rel=0.05)
    assert result.bins[11].ok == pytest.approx(200, rel=0.05)
