"""The request-level simulator against queueing theory: M/D/1 and M/G/1 waits (Pollaczek-Khinchine),
closed loops (throughput = clients / cycle time below saturation, capacity above, Little's law)."""

from __future__ import annotations

import pytest

from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import FleetSpec, ReplicaModel, Trace

SERVICE_S = 0.01


def single_server(**overrides) -> ReplicaModel:
    """One instance, batches of one, no front: a single FIFO server taking SERVICE_S."""
    settings = {"front_s": 0.0, "alpha_s": 0.0, "beta_s": SERVICE_S, "max_queue": 100_000} | overrides
    return ReplicaModel(**settings)


def poisson(rate_rps: float, requests: int) -> OpenLoad:
    return OpenLoad(Trace(step_s=requests / rate_rps, rates_rps=(rate_rps,)))


def pk_wait(rho: float, cv: float) -> float:
    """Pollaczek-Khinchine mean wait of an M/G/1 queue with service SERVICE_S of variation `cv`."""
    return rho * SERVICE_S * (1 + cv * cv) / (2 * (1 - rho))


@pytest.mark.parametrize("cv", [0.0, 0.5])
def test_mean_wait_matches_pollaczek_khinchine(cv):
    rho = 0.5
    waits = []
    for seed in range(2):
        result = simulate(FleetSpec(single_server(jitter_cv=cv), 1), poisson(rho / SERVICE_S, 25_000), seed=seed)
        answered = result.latency_s[result.status == 0]
        assert answered.size == result.status.size  # nothing refused with this queue
        waits.append(answered.mean() - SERVICE_S)
    assert sum(waits) / len(waits) == pytest.approx(pk_wait(rho, cv), rel=0.06)


def test_wait_grows_like_one_over_one_minus_rho():
    low = simulate(FleetSpec(single_server(), 1), poisson(0.3 / SERVICE_S, 20_000)).window(0, 1e9)
    high = simulate(FleetSpec(single_server(), 1), poisson(0.8 / SERVICE_S, 20_000)).window(0, 1e9)
    assert low.mean_s is not None and high.mean_s is not None
    assert (high.mean_s - SERVICE_S) / (low.mean_s - SERVICE_S) == pytest.approx(
        pk_wait(0.8, 0) / pk_wait(0.3, 0), rel=0.15
    )


def test_closed_loop_below_saturation_runs_at_clients_over_cycle_time():
    replica = single_server(overhead_s=0.03)  # a cycle is 10 ms served + 30 ms outside the replica
    stats = simulate(FleetSpec(replica, 1), ClosedLoad(2, 20.0)).window(2.0, 20.0)
    assert stats.throughput_rps == pytest.approx(2 / 0.04, rel=0.01)
    assert stats.p50_s == pytest.approx(0.04)  # two clients never queue behind each other


def test_closed_loop_above_saturation_runs_at_capacity_and_obeys_littles_law():
    replica = single_server(overhead_s=0.03)
    think_s = 0.02
    stats = simulate(FleetSpec(replica, 1), ClosedLoad(10, 20.0, think_s=think_s)).window(2.0, 20.0)
    assert stats.throughput_rps == pytest.approx(1 / SERVICE_S, rel=0.01)
    assert stats.mean_s is not None
    # Little's law over the clients' cycle: clients = throughput x (latency + think time).
    assert stats.throughput_rps * (stats.mean_s + think_s) == pytest.approx(10, rel=0.01)


def test_the_front_is_a_fifo_stage_of_its_own():
    # The front (4 ms) and the model (10 ms) pipeline: the model is the bottleneck, and a lone
    # request's latency is the sum of both.
    replica = single_server(front_s=0.004)
    busy = simulate(FleetSpec(replica, 1), ClosedLoad(8, 10.0)).window(1.0, 10.0)
    assert busy.throughput_rps == pytest.approx(1 / SERVICE_S, rel=0.01)
    alone = simulate(FleetSpec(replica, 1), ClosedLoad(1, 1.0)).window(0.0, 1.0)
    assert alone.p50_s == pytest.approx(0.014)
    front_bound = simulate(FleetSpec(single_server(front_s=0.02), 1), ClosedLoad(8, 10.0)).window(1.0, 10.0)
    assert front_bound.throughput_rps == pytest.approx(1 / 0.02, rel=0.01)


def wake_bound(**overrides) -> ReplicaModel:
    """A front whose loop costs 4 ms a wake-up and 1 ms a request, ahead of a model that takes
    0.1 ms a request in batches of up to 64."""
    settings = {"front_s": 0.001, "front_fixed_s": 0.004, "alpha_s": 0.0, "beta_s": 0.0001,
                "max_batch_size": 64, "max_queue": 100_000} | overrides
    return ReplicaModel(**settings)


def test_requests_that_arrive_together_share_the_fronts_wake_up():
    replica = wake_bound()
    alone = simulate(FleetSpec(replica, 1), ClosedLoad(1, 2.0))
    assert alone.window(0.0, 2.0).p50_s == pytest.approx(0.0051)  # a lone request pays the whole wake-up
    assert alone.cpu_per_answer_s == pytest.approx(0.0051)
    busy = simulate(FleetSpec(replica, 1), ClosedLoad(32, 10.0))
    stats = busy.window(1.0, 10.0)
    # 32 clients: each wake-up finds many waiting, so the front completes far more than 1 / 5 ms,
    # and never more than 1 / 1 ms (its per-request part)
    assert 2.5 / 0.005 < stats.throughput_rps < 1 / 0.001
    assert busy.cpu_per_answer_s < 0.5 * alone.cpu_per_answer_s
    # with no per-wake-up cost the same total per request is a plain FIFO stage
    fifo = simulate(FleetSpec(wake_bound(front_s=0.005, front_fixed_s=0.0), 1), ClosedLoad(32, 10.0))
    assert fifo.window(1.0, 10.0).throughput_rps == pytest.approx(1 / 0.005, rel=0.02)


def test_answers_cross_the_front_again_without_adding_work():
    """With `front_out_share` the answer's half of the front's work is done after the batch: a lone
    request takes as long as before, a front-bound replica completes as many, and its CPU is the same."""
    split = wake_bound(front_out_share=0.5)
    for replica in (wake_bound(), split):
        alone = simulate(FleetSpec(replica, 1), ClosedLoad(1, 2.0))
        assert alone.window(0.0, 2.0).p50_s == pytest.approx(0.0051)
    front_bound = [simulate(FleetSpec(wake_bound(front_s=0.005, front_fixed_s=0.0, front_out_share=share), 1),
                            ClosedLoad(16, 10.0)) for share in (0.0, 0.5)]
    x = [r.window(1.0, 10.0).throughput_rps for r in front_bound]
    assert x[1] == pytest.approx(x[0], rel=0.02)
    assert front_bound[1].cpu_per_answer_s == pytest.approx(front_bound[0].cpu_per_answer_s, rel=0.02)
    # an answer waits in the front's FIFO behind requests that arrived before it
    loaded = simulate(FleetSpec(split, 1), poisson(150, 4000), seed=3)
    assert loaded.window(0, 1e9).p50_s > 0.0051
    # two requests at once through a 4 ms front (half each way) and a 0.1 ms model: the first one's
    # answer reaches the front while the second one's way in holds it, so it leaves at 2 + 2 + 2 ms,
    # where a front without a way back answers it at 4.1 ms
    pair = [simulate(FleetSpec(wake_bound(front_s=0.004, front_fixed_s=0.0, front_out_share=share), 1),
                     ClosedLoad(2, 0.001)) for share in (0.0, 0.5)]
    assert sorted(pair[0].latency_s) == pytest.approx([0.0041, 0.0081])
    assert sorted(pair[1].latency_s) == pytest.approx([0.006, 0.008])
