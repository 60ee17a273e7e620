"""Replicas sharing one machine (`FleetSpec.node_cores`): processor sharing of fronts, batches and the
load generator's CPU, against what each would do on its own cores."""

from __future__ import annotations

import pytest

from servewell.plan.des import ClosedLoad, OpenLoad, simulate
from servewell.plan.model import FleetSpec, ReplicaModel, Trace

SERVICE_S = 0.01
CPU_BOUND = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=SERVICE_S, threads=1)


def throughput(fleet: FleetSpec, clients: int = 40, duration_s: float = 6.0) -> float:
    return simulate(fleet, ClosedLoad(clients, duration_s)).window(1.0, duration_s).throughput_rps


def test_two_replicas_on_two_cores_do_twice_one():
    one = throughput(FleetSpec(CPU_BOUND, 1, node_cores=2))
    two = throughput(FleetSpec(CPU_BOUND, 2, node_cores=2))
    assert one == pytest.approx(1 / SERVICE_S, rel=0.01)
    assert two == pytest.approx(2 * one, rel=0.01)


def test_three_replicas_on_two_cores_do_what_two_do():
    assert throughput(FleetSpec(CPU_BOUND, 3, node_cores=2)) == pytest.approx(2 / SERVICE_S, rel=0.02)
    # Own cores each (the Kubernetes case): three times one.
    assert throughput(FleetSpec(CPU_BOUND, 3)) == pytest.approx(3 / SERVICE_S, rel=0.01)


def test_a_multi_threaded_batch_is_slowed_by_its_neighbours():
    # Two replicas whose batches use 2 threads each on 2 cores: each runs at half speed.
    replica = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=SERVICE_S, threads=2)
    alone = simulate(FleetSpec(replica, 1, node_cores=2), ClosedLoad(1, 2.0)).window(0.0, 2.0)
    shared = simulate(FleetSpec(replica, 2, node_cores=2), ClosedLoad(2, 2.0)).window(0.0, 2.0)
    assert alone.p50_s == pytest.approx(SERVICE_S)
    assert shared.p50_s == pytest.approx(2 * SERVICE_S)


def test_the_front_and_the_batches_compete_for_one_core():
    replica = ReplicaModel(front_s=0.005, alpha_s=0.0, beta_s=0.005, threads=1)
    # On its own cores the two stages pipeline (200 req/s); on one core they take turns (100).
    assert throughput(FleetSpec(replica, 1)) == pytest.approx(200, rel=0.01)
    assert throughput(FleetSpec(replica, 1, node_cores=1)) == pytest.approx(100, rel=0.01)


def test_the_load_generators_cpu_contends():
    fleet = FleetSpec(CPU_BOUND, 1, node_cores=1, client_cpu_s=0.006, balancer_cpu_s=0.004)
    # 10 ms of the replica's work and 10 ms of the client's and balancer's per request, on one core
    # (the client, one process, sends one request at a time: a longer run for the queue it builds at
    # the start to drain).
    assert throughput(fleet, duration_s=20.0) == pytest.approx(1 / (2 * SERVICE_S), rel=0.02)
    # Without node_cores the client's CPU is free (its own machine).
    assert throughput(FleetSpec(CPU_BOUND, 1, client_cpu_s=0.01)) == pytest.approx(1 / SERVICE_S, rel=0.01)


def test_the_load_generator_is_in_each_requests_path():
    """One load-generator process on the node: a request waits for it to be sent, so a burst of
    arrivals queues at the client before the replica sees it."""
    alone = simulate(FleetSpec(CPU_BOUND, 1, node_cores=2), OpenLoad(Trace(20.0, (50.0,))), seed=2)
    with_client = simulate(FleetSpec(CPU_BOUND, 1, node_cores=2, client_cpu_s=0.015),
                           OpenLoad(Trace(20.0, (50.0,))), seed=2)
    a, b = alone.window(1.0, 20.0), with_client.window(1.0, 20.0)
    assert b.p50_s is not None and a.p50_s is not None and b.p99_s is not None and a.p99_s is not None
    assert b.p50_s >= a.p50_s + 0.015 - 1e-9  # its own CPU is in the path
    assert b.p99_s > a.p99_s + 0.015  # and so is its queue (75 % busy)


def test_open_load_on_a_shared_node_answers_everything_below_capacity():
    fleet = FleetSpec(CPU_BOUND, 3, node_cores=2, client_cpu_s=0.001)
    result = simulate(fleet, OpenLoad(Trace(10.0, (120.0,))), seed=4)
    assert (result.status == 0).all()
    assert result.window(0.0, 10.0).throughput_rps == pytest.approx(120, rel=0.05)
