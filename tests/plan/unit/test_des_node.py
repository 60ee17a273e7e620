"""Replicas sharing one machine (`FleetSpec.node_cores`): processor sharing of fronts, batches and the
load generator's CPU, against what each would do on its own cores."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servewell_plan.des import ClosedLoad, OpenLoad, WindowStats, simulate
from servewell_plan.des_node import BATCH, FRONT, NodeJob, SharedNode, nice_weight
from servewell_plan.model import FleetSpec, ReplicaModel, Trace

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


# --- weighted sharing: model workers run niced (des_node) ---------------------------------------

NICE5 = nice_weight(5)


def finish_times(node: SharedNode, jobs: list[tuple[NodeJob, float]]) -> dict[int, float]:
    """Start every job at 0 and run the node to the end: each job's finish time, by its index; and
    checks that each job's class clock advanced by exactly its work while it ran."""
    starts = {id(job): node.add(0.0, job, work) for job, work in jobs}
    index = {id(job): i for i, (job, _) in enumerate(jobs)}
    works = {id(job): work for job, work in jobs}
    done: dict[int, float] = {}
    while (t := node.next_finish_s()) < float("inf"):
        for job in node.pop_done(t):
            assert node.vtime(SharedNode.class_of(job)) - starts[id(job)] == pytest.approx(works[id(job)])
            done[index[id(job)]] = t
    return done


def test_the_kernels_weights_of_nice():
    assert nice_weight(0) == 1.0
    assert NICE5 == pytest.approx(335 / 1024)
    assert nice_weight(19) == pytest.approx(15 / 1024)
    assert nice_weight(-3) == 1.0 and nice_weight(40) == nice_weight(19)  # clamped to what Linux allows


def test_a_niced_batch_gets_its_weighted_share_of_a_contended_core():
    node = SharedNode(1, NICE5)
    done = finish_times(node, [(NodeJob(FRONT, None, None, 1), 1.0), (NodeJob(BATCH, None, [0], 1), 1.0)])
    # Together: the front at 1 / (1 + w), the batch at w / (1 + w); the front ends at 1 + w, when the
    # batch has done w of its work; the rest alone at full speed. The core never idles.
    assert done[0] == pytest.approx(1 + NICE5)
    assert done[1] == pytest.approx(2.0)
    # At the same weight (nice 0) both end together, as plain processor sharing.
    assert finish_times(SharedNode(1), [(NodeJob(FRONT, None, None, 1), 1.0),
                                        (NodeJob(BATCH, None, [0], 1), 1.0)]) == {0: 2.0, 1: 2.0}


def test_weights_only_matter_when_threads_outnumber_cores():
    node = SharedNode(2, NICE5)
    done = finish_times(node, [(NodeJob(FRONT, None, None, 1), 1.0), (NodeJob(BATCH, None, [0], 1), 1.0)])
    assert done == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}


def test_cores_the_heavier_class_cannot_use_go_to_the_lighter():
    # 2 cores, one front thread and a 2-thread batch: the front's share 2 * 1 / (1 + 2w) is more than
    # its one core, so it runs at full speed and the batch's two threads share the other core.
    node = SharedNode(2, NICE5)
    done = finish_times(node, [(NodeJob(FRONT, None, None, 1), 1.0), (NodeJob(BATCH, None, [0], 2), 1.0)])
    assert done[0] == pytest.approx(1.0)
    assert done[1] == pytest.approx(1.5)  # half speed for 1 s, then both cores


def test_a_cancelled_pods_jobs_stop_taking_cpu_from_the_others():
    node = SharedNode(1, NICE5)
    owner = object()  # the node only compares a job's pod by identity
    batch = NodeJob(BATCH, owner, [0], 1)
    front = NodeJob(FRONT, None, None, 1)
    node.add(0.0, batch, 10.0)
    node.add(0.0, front, 1.0)
    node.cancel_pod(0.5, owner)
    # Half a second shared (the front at 1 / (1 + w)), then alone at full speed.
    assert node.next_finish_s() == pytest.approx(0.5 + (1.0 - 0.5 / (1 + NICE5)))


def test_a_niced_worker_changes_nothing_on_its_own_cores_and_only_the_latency_on_a_shared_one():
    replica = ReplicaModel(front_s=0.004, alpha_s=0.0, beta_s=0.004, threads=1, worker_nice=5)
    # Own cores: the weight never applies (identical to nice 0).
    own = simulate(FleetSpec(replica, 1), OpenLoad(Trace(20.0, (150.0,))), seed=3).window(1.0, 20.0)
    same = simulate(FleetSpec(replace(replica, worker_nice=0), 1), OpenLoad(Trace(20.0, (150.0,))),
                    seed=3).window(1.0, 20.0)
    assert (own.p50_s, own.p99_s) == (same.p50_s, same.p99_s)
    # One shared core at 60 % busy: the niced batches wait behind the fronts, so requests take longer
    # (the front gets the core first); the work is the same, so everything is still answered.
    def shared(nice: int) -> WindowStats:
        fleet = FleetSpec(replace(replica, worker_nice=nice), 1, node_cores=1)
        return simulate(fleet, OpenLoad(Trace(20.0, (75.0,))), seed=3).window(1.0, 20.0)
    niced, plain = shared(5), shared(0)
    assert niced.throughput_rps == pytest.approx(plain.throughput_rps, rel=0.02)
    assert niced.p50_s is not None and plain.p50_s is not None and niced.p50_s > plain.p50_s


def test_a_heavier_batch_class_is_water_filled_first():
    # Weights above 1 (not servewell's: its workers are never favoured) still share correctly. Two
    # fronts and a batch at weight 4 on 2 cores: the batch's share, 2 x 4 / 6, is more than its one
    # thread can use, so it runs at full speed and the two fronts share the other core.
    node = SharedNode(2, 4.0)
    done = finish_times(node, [(NodeJob(FRONT, None, None, 1), 1.0), (NodeJob(FRONT, None, None, 1), 1.0),
                               (NodeJob(BATCH, None, [0], 1), 1.0)])
    assert done[2] == pytest.approx(1.0)
    assert done[0] == done[1] == pytest.approx(1.5)  # half speed for 1 s, then a core each
