"""The batcher's window policy: full batches go at once, a lone request waits max_wait_s, an urgent
one does not, and batching buys throughput beyond one request per batch time."""

from __future__ import annotations

import numpy as np
import pytest

from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import FleetSpec, ReplicaModel, Trace

ALPHA_S, BETA_S = 0.008, 0.001


def batching(**overrides) -> ReplicaModel:
    settings = {"front_s": 0.0, "alpha_s": ALPHA_S, "beta_s": BETA_S, "max_batch_size": 8, "max_wait_s": 0.005}
    return ReplicaModel(**(settings | overrides))


def test_full_batches_beat_one_request_per_batch_time():
    replica = batching(instances=2)
    stats = simulate(FleetSpec(replica, 1), ClosedLoad(32, 10.0)).window(1.0, 10.0)
    unbatched = 2 / (ALPHA_S + BETA_S)  # two instances, one request each per batch
    assert stats.throughput_rps == pytest.approx(replica.saturation_rps, rel=0.01)
    assert stats.throughput_rps > 3 * unbatched


def test_a_lone_request_waits_max_wait_then_runs_alone():
    stats = simulate(FleetSpec(batching(), 1), ClosedLoad(1, 1.0)).window(0.0, 1.0)
    assert stats.p50_s == pytest.approx(0.005 + ALPHA_S + BETA_S)
    assert stats.p99_s == pytest.approx(0.005 + ALPHA_S + BETA_S)


def test_a_full_batch_does_not_wait_for_the_window():
    # Eight clients fill a batch at once; with a 1 s window they would otherwise wait a second.
    stats = simulate(FleetSpec(batching(max_wait_s=1.0), 1), ClosedLoad(8, 2.0)).window(0.0, 2.0)
    assert stats.p99_s == pytest.approx(ALPHA_S + 8 * BETA_S)


def test_an_urgent_request_does_not_wait():
    trace = Trace(step_s=1000.0, rates_rps=(0.02,), urgent_share=1.0)  # about 20 requests, far apart
    result = simulate(FleetSpec(batching(max_wait_s=0.5), 1), OpenLoad(trace), seed=3)
    answered = result.latency_s[result.status == 0]
    assert answered.size > 5
    assert answered.max() == pytest.approx(ALPHA_S + BETA_S)
    normal = simulate(FleetSpec(batching(max_wait_s=0.5), 1), OpenLoad(Trace(1000.0, (0.02,))), seed=3)
    # The same arrivals in the normal lane wait the window (two close together share a batch).
    assert float(np.median(normal.latency_s)) == pytest.approx(0.5 + ALPHA_S + BETA_S)


def test_urgent_requests_jump_the_queue():
    # Saturated replica, 20 % urgent: the urgent lane's wait stays near one batch, the normal lane
    # queues behind.
    replica = batching(max_batch_size=4, max_wait_s=0.0, max_queue=10_000)
    rate = 1.3 * replica.saturation_rps  # overloaded: the normal queue grows all along
    trace = Trace(step_s=4000 / rate, rates_rps=(rate,), urgent_share=0.2)
    result = simulate(FleetSpec(replica, 1), OpenLoad(trace), seed=1)
    late = result.arrival_s > trace.duration_s / 2
    latency = result.latency_s[late]
    assert latency.min() < 3 * replica.batch_s(4)  # some (the urgent ones) pass at once
    assert latency.max() > 20 * replica.batch_s(4)  # the normal lane is deep by then


def test_max_wait_zero_dispatches_whatever_waits():
    stats = simulate(FleetSpec(batching(max_wait_s=0.0), 1), ClosedLoad(1, 1.0)).window(0.0, 1.0)
    assert stats.p50_s == pytest.approx(ALPHA_S + BETA_S)
