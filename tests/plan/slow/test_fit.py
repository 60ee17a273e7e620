"""plan.fit against curves made by the simulator from a known replica: the fit must reproduce the
curve, and where the closed loop cannot tell the stages apart it must keep the pessimistic one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from servewell_plan.curve import CurvePoint, CurveSettings, IdlePoint, MeasuredCurve
from servewell_plan.des import OpenLoad, simulate
from servewell_plan.fit import fit_replica, idle_cost, open_p99_s, simulate_point
from servewell_plan.model import FleetSpec, ReplicaModel, Trace
from servewell_plan.sizing import ROUGH_FIT_ERROR

LADDER = (1, 4, 8, 32)


def curve_of(replica: ReplicaModel, ladder: tuple[int, ...] = LADDER, *, with_cpu: bool = False) -> MeasuredCurve:
    points = []
    for clients in ladder:
        x, p50, p99, cpu = simulate_point(replica, clients, None, seed=7, requests=4000)
        points.append(CurvePoint(clients, x, p50, p99, server_cpu_s=cpu if with_cpu else None))
    settings = CurveSettings(max_batch_size=replica.max_batch_size, instances=replica.instances,
                             threads=replica.threads)
    return MeasuredCurve("synthetic", "test", settings, tuple(points))


@pytest.mark.parametrize("replica", [
    # a model-bound CPU ResNet-50: batching saves nothing, a cheap frontend
    ReplicaModel(front_s=0.012, alpha_s=0.0, beta_s=0.078, max_batch_size=8, jitter_cv=0.05),
    # a small model that batches well behind a busier frontend
    ReplicaModel(front_s=0.0004, alpha_s=0.004, beta_s=0.0001, max_batch_size=32, jitter_cv=0.15),
])
def test_the_fit_reproduces_a_curve_the_simulator_made(replica: ReplicaModel):
    curve = curve_of(replica)
    fit = fit_replica(curve, seed=1)
    assert fit.error < ROUGH_FIT_ERROR / 2, fit
    assert fit.replica.worker_nice == 0  # the curve does not say its workers' niceness: no weights
    for point in fit.points:
        assert point.throughput_rps == pytest.approx(point.measured.throughput_rps, rel=0.15)
        assert math.log(point.p99_s / point.measured.p99_s) == pytest.approx(0, abs=0.35)


def test_a_curve_that_says_its_workers_niceness_gives_it_to_the_fitted_replica():
    curve = curve_of(ReplicaModel(front_s=0.0004, alpha_s=0.004, beta_s=0.0001, max_batch_size=32), (1, 8))
    assert fit_replica(replace(curve, settings=replace(curve.settings, nice=5)), seed=1).replica.worker_nice == 5


def test_when_the_closed_loop_cannot_tell_the_stages_apart_the_fit_keeps_the_slower_open_loop():
    """A model that gains nothing by batching answers a whole batch at its end: under an open load its
    p99 is higher than a serial frontend's with the same closed-loop ladder. The fit must not promise
    the lower one."""
    truth = ReplicaModel(front_s=0.012, alpha_s=0.0, beta_s=0.078, max_batch_size=8, jitter_cv=0.05)
    fit = fit_replica(curve_of(truth), seed=1)
    assert fit.bottleneck == "model"
    assert open_p99_s(fit.replica, None, 3) >= 0.85 * open_p99_s(truth, None, 3)


def test_a_curve_the_model_cannot_describe_has_a_large_error():
    """Throughput that falls as clients rise (a server that thrashes) is not a queueing replica."""
    points = (CurvePoint(1, 500.0, 0.002, 0.004), CurvePoint(4, 1500.0, 0.0027, 0.006),
              CurvePoint(8, 300.0, 0.027, 0.2))
    curve = MeasuredCurve("thrash", "test", CurveSettings(max_batch_size=8), points)
    assert fit_replica(curve, seed=1).error > ROUGH_FIT_ERROR


def open_load(replica: ReplicaModel, rate_rps: float) -> tuple[float, float]:
    """(p50, CPU per answer) of one replica under a Poisson load at `rate_rps`."""
    duration = 4000 / rate_rps
    result = simulate(FleetSpec(replica, 1), OpenLoad(Trace(duration, (rate_rps,))), seed=5)
    stats = result.window(0.1 * duration, duration)
    assert stats.p50_s is not None
    return stats.p50_s, result.cpu_per_answer_s


def test_a_ladder_with_the_servers_cpu_predicts_an_open_load_of_a_front_that_amortizes_its_wake_ups():
    """A tiny model behind a front whose loop costs more per wake-up than per request (the MLP on
    this VM): a closed ladder packs requests together, an open load at a lower rate does not, so its
    CPU per request is higher. With the CPU per step in the curve, the fit must carry that over."""
    truth = ReplicaModel(front_s=0.0003, front_fixed_s=0.0009, alpha_s=0.0004, beta_s=0.00003, max_batch_size=32,
                         jitter_cv=0.3, front_out_share=0.5)
    fit = fit_replica(curve_of(truth, with_cpu=True), seed=1)
    assert fit.error < ROUGH_FIT_ERROR / 2, fit
    rate = 0.4 * truth.saturation_rps
    (p50_truth, cpu_truth), (p50_fit, cpu_fit) = open_load(truth, rate), open_load(fit.replica, rate)
    assert cpu_fit == pytest.approx(cpu_truth, rel=0.2)
    assert p50_fit == pytest.approx(p50_truth, rel=0.3)


def test_the_idle_cost_is_the_idle_steps_extra_over_the_one_client_step_split_into_cpu_and_delay():
    lone = CurvePoint(1, 600.0, 0.0015, 0.003, server_cpu_s=0.0014)
    idle = (IdlePoint(0.002, 0.0017, 0.0015), IdlePoint(0.005, 0.0024, 0.0022), IdlePoint(0.02, 0.0023, 0.0029))
    curve = MeasuredCurve("m", "test", CurveSettings(), (lone, CurvePoint(4, 1500.0, 0.0027, 0.006)),
                          idle_points=idle)
    table = idle_cost(curve)
    assert [t[0] for t in table] == [0.002, 0.005, 0.02]
    assert [t[1] for t in table] == pytest.approx([0.0001, 0.0008, 0.0009])  # never above the extra latency
    assert [t[1] + t[2] for t in table] == pytest.approx([0.0002, 0.0009, 0.0009])  # a longer idle never costs less
    no_cpu = replace(curve, idle_points=tuple(replace(p, server_cpu_s=None) for p in idle))
    assert all(t[1] == 0 for t in idle_cost(no_cpu))  # unknown CPU is not invented: a delay
    assert idle_cost(replace(curve, points=curve.points[1:])) == ()  # nothing to compare with
    assert idle_cost(replace(curve, idle_points=())) == ()
