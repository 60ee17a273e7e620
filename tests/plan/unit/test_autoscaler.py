"""The HPA controller model against the Kubernetes documentation's worked examples."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servewell_plan.autoscaler import HorizontalAutoscaler
from servewell_plan.model import AutoscalerSpec, ScalingPolicy, ScalingRules, ScalingSample, ScalingSignal

NO_WINDOW = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0),), "Max")
FAST_UP = ScalingRules(0.0, (ScalingPolicy("Percent", 1000, 15.0),), "Max")


def cpu_spec(**overrides) -> AutoscalerSpec:
    spec = AutoscalerSpec(
        ScalingSignal.CPU, 0.5, min_replicas=1, max_replicas=100, scale_up=FAST_UP, scale_down=NO_WINDOW
    )
    return replace(spec, **overrides)


def at(current: int, value: float, unready: int = 0) -> ScalingSample:
    """`current` ready pods all reporting `value`, plus `unready` pods without metrics."""
    return ScalingSample(current + unready, (value,) * current, unready)


def test_one_pod_at_twice_the_target_becomes_two():
    hpa = HorizontalAutoscaler(cpu_spec(), 1)
    assert hpa.sync(0.0, at(1, 1.0)) == 2  # 100 % against a 50 % target


def test_the_docs_ratio_example_halves_at_half_the_target():
    # "if the current metric value is 50m and the desired value is 100m, the number of replicas will
    # be halved"
    spec = cpu_spec(signal=ScalingSignal.QUEUE_DEPTH, target=0.1)
    hpa = HorizontalAutoscaler(spec, 4)
    assert hpa.sync(0.0, at(4, 0.05)) == 2


def test_a_ratio_within_tolerance_keeps_the_size():
    hpa = HorizontalAutoscaler(cpu_spec(), 4)
    assert hpa.sync(0.0, at(4, 0.5 * 1.05)) == 4
    assert hpa.sync(15.0, at(4, 0.5 * 0.95)) == 4
    assert hpa.sync(30.0, at(4, 0.5 * 1.2)) == 5  # ceil(1.2 x 4)


def test_exact_ratios_do_not_round_up_on_float_noise():
    hpa = HorizontalAutoscaler(cpu_spec(target=0.7), 3)
    assert hpa.sync(0.0, ScalingSample(3, (1.4, 1.4, 1.4), 0)) == 6


def test_no_metrics_keeps_the_size():
    hpa = HorizontalAutoscaler(cpu_spec(), 3)
    assert hpa.sync(0.0, ScalingSample(3, (), 3)) == 3


def test_scale_down_waits_for_the_stabilization_window():
    down = ScalingRules(300.0, (ScalingPolicy("Percent", 100, 15.0),), "Max")
    hpa = HorizontalAutoscaler(cpu_spec(scale_down=down), 4)
    # The initial size counts as recommended up to the first sync (t=0); every later one says 1.
    sizes = [hpa.sync(float(t), at(4, 0.1)) for t in range(0, 300, 15)]
    assert sizes == [4] * len(sizes)
    assert hpa.sync(300.0, at(4, 0.1)) == 1  # the t=0 recommendation has left the window


def test_a_brief_spike_inside_the_window_holds_the_size():
    down = ScalingRules(300.0, (ScalingPolicy("Percent", 100, 15.0),), "Max")
    hpa = HorizontalAutoscaler(cpu_spec(scale_down=down), 8)
    for t in range(0, 300, 15):
        low = t != 150
        assert hpa.sync(float(t), at(8, 0.1 if low else 0.5)) == 8
    assert hpa.sync(435.0, at(8, 0.1)) == 8  # the t=150 recommendation (8) is still in the window
    assert hpa.sync(450.0, at(8, 0.1)) == 2


def test_the_default_scale_up_policies_give_5_then_10_from_one():
    spec = AutoscalerSpec(ScalingSignal.CPU, 0.5, min_replicas=1, max_replicas=100)  # 100 %/15 s, 4 pods/15 s
    hpa = HorizontalAutoscaler(spec, 1)
    assert hpa.sync(0.0, at(1, 50.0)) == 5  # max(ceil(1 x 2), 1 + 4)
    assert hpa.sync(15.0, at(5, 50.0)) == 10  # max(5 x 2, 5 + 4)
    assert hpa.sync(30.0, at(10, 50.0)) == 20


def test_a_policy_counts_the_changes_made_within_its_period():
    up = ScalingRules(0.0, (ScalingPolicy("Pods", 4, 60.0),), "Max")
    hpa = HorizontalAutoscaler(cpu_spec(scale_up=up), 2)
    assert hpa.sync(0.0, at(2, 50.0)) == 6
    assert hpa.sync(15.0, at(6, 50.0)) == 6  # 4 pods already added within the last 60 s
    assert hpa.sync(45.0, at(6, 50.0)) == 6
    assert hpa.sync(60.0, at(6, 50.0)) == 10  # the t=0 event left the period


def test_percent_scale_down_steps_by_a_quarter_per_minute():
    down = ScalingRules(0.0, (ScalingPolicy("Percent", 25, 60.0),), "Min")
    hpa = HorizontalAutoscaler(cpu_spec(scale_down=down), 80)
    sizes = [hpa.sync(float(t), at(hpa.replicas, 0.001)) for t in range(0, 181, 15)]
    # 80 -> 60 at t=0, held for the period, 60 -> 45 at t=60, 45 -> 33 at t=120 (int(45 x 0.75)).
    assert sizes[0] == 60
    assert sizes[1:4] == [60, 60, 60]
    assert sizes[4] == 45
    assert sizes[8] == 33
    assert sizes[12] == 24


def test_the_docs_percent_example_removes_8_of_80_then_8_of_72():
    down = ScalingRules(0.0, (ScalingPolicy("Pods", 4, 60.0), ScalingPolicy("Percent", 10, 60.0)), "Max")
    hpa = HorizontalAutoscaler(cpu_spec(scale_down=down), 80)
    assert hpa.sync(0.0, at(80, 0.01)) == 72
    assert hpa.sync(60.0, at(72, 0.01)) == 64  # 7.2 rounds up to 8 removed


def test_select_min_takes_the_least_change_and_disabled_none():
    up_min = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0)), "Min")
    assert HorizontalAutoscaler(cpu_spec(scale_up=up_min), 10).sync(0.0, at(10, 5.0)) == 14
    off = ScalingRules(0.0, (ScalingPolicy("Percent", 100, 15.0),), "Disabled")
    assert HorizontalAutoscaler(cpu_spec(scale_up=off), 10).sync(0.0, at(10, 5.0)) == 10
    assert HorizontalAutoscaler(cpu_spec(scale_down=off), 10).sync(0.0, at(10, 0.01)) == 10


def test_min_and_max_clamp():
    hpa = HorizontalAutoscaler(cpu_spec(min_replicas=3, max_replicas=6), 4)
    assert hpa.sync(0.0, at(4, 5.0)) == 6
    assert hpa.sync(15.0, at(6, 0.01)) == 3
    # Out of range (someone edited spec.replicas): straight back to the bound.
    assert hpa.sync(30.0, at(9, 0.5)) == 6
    assert hpa.sync(45.0, at(1, 0.5)) == 3


def test_unready_pods_damp_a_scale_up():
    # 2 ready pods at 200 % of the target, 2 starting: counted at 0 the mean is at the target.
    hpa = HorizontalAutoscaler(cpu_spec(), 4)
    assert hpa.sync(0.0, at(2, 1.0, unready=2)) == 4
    # At 300 %: (1.5 + 1.5 + 0 + 0) / 4 = 0.75 = 150 % of target -> ceil(1.5 x 4) = 6, where the ready
    # pods' ratio applied to every pod would ask for 12.
    hpa = HorizontalAutoscaler(cpu_spec(), 4)
    assert hpa.sync(0.0, at(2, 1.5, unready=2)) == 6
    # Hot ready pods never make the fleet shrink: (0.75 + 0.75) / 4 pods is 75 % of target, a reversed
    # direction, so the size stays (the ready pods alone would give ceil(1.5 x 2) = 3).
    hpa = HorizontalAutoscaler(cpu_spec(), 4)
    assert hpa.sync(0.0, at(2, 0.75, unready=2)) == 4


def test_unready_pods_do_not_change_a_scale_down():
    hpa = HorizontalAutoscaler(cpu_spec(), 6)
    assert hpa.sync(0.0, at(4, 0.125, unready=2)) == 1  # ceil(0.25 x 4 ready)


def test_queue_wait_scales_the_ready_pods_by_value_over_target():
    spec = AutoscalerSpec(ScalingSignal.QUEUE_WAIT, 0.25, min_replicas=1, max_replicas=100, scale_up=FAST_UP)
    hpa = HorizontalAutoscaler(spec, 4)
    assert hpa.sync(0.0, ScalingSample(4, (), 0, fleet_value=0.5)) == 8
    assert hpa.sync(15.0, ScalingSample(8, (), 0, fleet_value=0.26)) == 8  # within tolerance
    assert hpa.sync(30.0, ScalingSample(8, (0.0,) * 6, 2, fleet_value=0.5)) == 12  # 6 ready pods x 2
    assert hpa.sync(45.0, ScalingSample(12, (), 0, fleet_value=None)) == 12


def test_invalid_specs_are_refused():
    with pytest.raises(ValueError, match="target"):
        HorizontalAutoscaler(cpu_spec(target=0.0), 1)
    with pytest.raises(ValueError, match="selectPolicy"):
        HorizontalAutoscaler(cpu_spec(scale_up=ScalingRules(0.0, (), "Biggest")), 1)
    with pytest.raises(ValueError, match="Pods or Percent"):
        HorizontalAutoscaler(cpu_spec(scale_up=ScalingRules(0.0, (ScalingPolicy("Nodes", 1, 15.0),))), 1)
