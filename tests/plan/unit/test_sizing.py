"""plan.sizing on a hand-made fit and latency table (no simulation): what the plan refuses before
any fit, and what it says of a pod whose CPU request sits mostly idle."""

from __future__ import annotations

import pytest

from servewell_plan.curve import CurvePoint, CurveSettings, MeasuredCurve
from servewell_plan.fit import FitResult, PointFit
from servewell_plan.latency_table import LoadRow
from servewell_plan.model import LatencyTable, ReplicaModel, Trace
from servewell_plan.sizing import Plan, PlanInputs, check_plannable, make_plan

UTILIZATIONS = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9)


def curve(*points: tuple[int, float, float, float]) -> MeasuredCurve:
    return MeasuredCurve("m", "test", CurveSettings(), tuple(CurvePoint(*p) for p in points))


def plan_for(replica: ReplicaModel, bottleneck: str, *, slo_s: float = 0.2, steps: int = 5) -> Plan:
    """A plan for a replica whose p99 grows like 30 ms / (1 - utilization): the SLO of 200 ms (180 ms
    with the margin) holds up to 80 % of its capacity, which a steady load makes the target too."""
    capacity = replica.saturation_rps
    rows = [LoadRow(u, 0.02 / (1 - u), 0.02 / (1 - u), 0.03 / (1 - u), 0.0, u * 0.5) for u in UTILIZATIONS]
    table = LatencyTable(capacity, UTILIZATIONS, (0.5, 0.99), tuple((r.p50_s, r.p99_s) for r in rows),
                         (0.0,) * len(rows))
    points = tuple(PointFit(CurvePoint(c, capacity / 2, 0.02, 0.03), capacity / 2, 0.02, 0.03)
                   for c in range(1, steps + 1))
    fit = FitResult(replica, 0.05, points, bottleneck)
    return make_plan(fit, table, rows, PlanInputs(slo_s, 0.001, Trace(3600.0, (4 * capacity,))))


def test_a_one_step_curve_is_refused_before_any_fit_saying_what_it_needs():
    with pytest.raises(ValueError, match=r"the curve has 1 step\(s\) \(concurrency 4\); plan needs at least 2 "
                                         r"at different concurrencies, and 4 or more") as refused:
        check_plannable(curve((4, 300.0, 0.010, 0.015)), slo_s=0.1)
    assert "--concurrency 1,2,4,8,16,32" in str(refused.value)
    check_plannable(curve((1, 100.0, 0.010, 0.012), (4, 300.0, 0.013, 0.020)), slo_s=0.1)  # two steps: planned


def test_an_slo_under_the_unloaded_p99_is_refused_naming_the_floor():
    measured = curve((1, 100.0, 0.010, 0.012), (4, 300.0, 0.013, 0.020), (8, 320.0, 0.025, 0.040))
    with pytest.raises(ValueError, match=r"--slo-p99-ms 13 is below what this replica can meet at any load: its "
                                         r"unloaded p99 \(the 1-client step\) is 12\.0 ms, .* the lowest SLO it can "
                                         r"plan for is 13\.3 ms"):
        check_plannable(measured, slo_s=0.013)
    check_plannable(measured, slo_s=0.014)  # above the floor: the fit decides
    no_lone_step = curve((4, 300.0, 0.013, 0.020), (8, 320.0, 0.025, 0.040))
    check_plannable(no_lone_step, slo_s=0.013)  # no unloaded step: no floor is invented


def test_a_pod_that_uses_under_half_its_cores_at_the_target_is_offered_the_smaller_pod_and_the_threads():
    # A model-bound replica whose front barely works: its front's core sits idle.
    replica = ReplicaModel(front_s=0.0005, alpha_s=0.0, beta_s=0.02)  # 50 req/s, 2 cores requested
    plan = plan_for(replica, "model")
    assert plan.target_rps == pytest.approx(40.0)  # 80 % of 50 req/s
    assert plan.cpu_at_target_cores == pytest.approx(40 * 0.0205)  # 0.82 of 2 cores: 41 %
    assert plan.smaller_pod_cores == pytest.approx(0.9)
    assert plan.model_threads_to_fill == 2
    step = plan.reasoning[-1]
    assert step.startswith("8. CPU request. At the target the pod keeps about 0.82 of its 2 requested cores busy "
                           "(41%)"), step
    assert 'The smaller pod: requests.cpu "900m"' in step and 'limits.cpu "2"' in step
    assert "2 model threads in all instead of 1 x 1, as threads 2 (faster batches) or instances 2" in step


def test_a_pod_that_uses_its_cores_is_told_nothing_more():
    replica = ReplicaModel(front_s=0.015, alpha_s=0.0, beta_s=0.02)  # 1.4 of 2 cores at 40 req/s
    plan = plan_for(replica, "model")
    assert plan.cpu_at_target_cores == pytest.approx(1.4)
    assert plan.smaller_pod_cores is None and plan.model_threads_to_fill is None
    assert len(plan.reasoning) == 7


def test_a_frontend_bound_pod_is_offered_the_smaller_pod_only():
    replica = ReplicaModel(front_s=0.004, alpha_s=0.0, beta_s=0.0005, max_batch_size=8, instances=1, threads=2)
    plan = plan_for(replica, "frontend")  # 250 req/s, 3 cores requested; 1.0 used at 200 req/s
    assert plan.smaller_pod_cores == pytest.approx(1.0)
    assert plan.model_threads_to_fill is None
    assert plan.reasoning[-1].endswith("The front is the bottleneck: more model threads would not carry more load "
                                       "per pod.")


def test_a_curve_of_few_steps_makes_the_plan_say_its_figures_are_rough():
    replica = ReplicaModel(front_s=0.015, alpha_s=0.0, beta_s=0.02)
    assert "The curve has only 2 steps" in plan_for(replica, "model", steps=2).reasoning[0]
    assert "The curve has only" not in plan_for(replica, "model", steps=4).reasoning[0]


def test_the_manifest_values_offer_the_smaller_pod_beside_the_measured_one():
    from servewell_plan.command import manifests_text, summary

    plan = plan_for(ReplicaModel(front_s=0.0005, alpha_s=0.0, beta_s=0.02), "model")
    lines = manifests_text(plan).splitlines()
    at = lines.index('  resources.requests.cpu: "2"')
    assert lines[at + 1] == '  or the smaller pod (reasoning 8): resources.requests.cpu: "900m", limits.cpu: "2"'
    doc = summary(plan)
    assert doc["smaller_pod"]["cpu"] == pytest.approx(0.9) and doc["model_threads_to_fill"] == 2
    assert doc["cpu_cores_used"]["at_target"] == pytest.approx(0.82)
    busy = plan_for(ReplicaModel(front_s=0.015, alpha_s=0.0, beta_s=0.02), "model")
    assert "smaller pod" not in manifests_text(busy) and summary(busy)["smaller_pod"] is None
