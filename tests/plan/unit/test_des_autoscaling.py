"""The simulator driving the HPA model (`plan.autoscaler`): pods it adds cost from their creation and
serve only after their start delay; pods it removes drain without failing anything; each signal
relieves an overload."""

from __future__ import annotations

import numpy as np
import pytest

from servewell_plan.des import OpenLoad, simulate
from servewell_plan.model import (
    AutoscalerSpec,
    FleetSpec,
    ReplicaModel,
    ScalingPolicy,
    ScalingRules,
    ScalingSignal,
    Trace,
)

REPLICA = ReplicaModel(front_s=0.0, alpha_s=0.0, beta_s=0.01, max_queue=1000, cold_start_s=6.0)  # 100 req/s
POD_START_S = 4.0  # + cold start: ready 10 s after creation
ONE_POD_PER_SYNC = ScalingRules(0.0, (ScalingPolicy("Pods", 1, 10.0),), "Max")


def autoscaled(
    replicas: int, signal: ScalingSignal, target: float, *, window_s: float = 0.0, down_window_s: float = 0.0
) -> FleetSpec:
    scale_down = ScalingRules(down_window_s, ONE_POD_PER_SYNC.policies, "Max")
    spec = AutoscalerSpec(
        signal,
        target,
        min_replicas=1,
        max_replicas=3,
        sync_s=10.0,
        metric_window_s=window_s,
        scale_up=ONE_POD_PER_SYNC,
        scale_down=scale_down,
    )
    return FleetSpec(REPLICA, replicas, autoscaler=spec, pod_start_s=POD_START_S)


def test_added_pods_cost_from_creation_and_serve_after_their_start_delay():
    # 50 req/s on one replica of two cores: CPU 25 % against a 10 % target, so one pod more per sync
    # (at 10 s and 20 s) up to three.
    result = simulate(autoscaled(1, ScalingSignal.CPU, 0.1), OpenLoad(Trace(60.0, (50.0,))), bin_s=5.0)
    ready = [b.replicas_ready for b in result.bins]
    total = [b.replicas_total for b in result.bins]
    assert total == [1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert ready == [1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3]
    assert result.replica_seconds == pytest.approx(60 + 50 + 40)
    assert result.replica_seconds == pytest.approx(sum(b.replicas_total * 5.0 for b in result.bins))


def test_removed_pods_drain_without_failing_requests():
    result = simulate(autoscaled(3, ScalingSignal.CPU, 0.9), OpenLoad(Trace(60.0, (50.0,))), bin_s=5.0)
    assert not (result.status == 2).any() and not (result.status == 1).any()
    ready = [b.replicas_ready for b in result.bins]
    assert ready[:2] == [3, 3] and ready[2:4] == [2, 2] and ready[4:] == [1] * 8
    # A removed pod costs until its last request is answered: a little past each scale-down.
    assert 90.0 < result.replica_seconds < 90.5


@pytest.mark.parametrize(
    ("signal", "target", "window_s"),
    [
        (ScalingSignal.QUEUE_DEPTH, 5.0, 0.0),
        (ScalingSignal.QUEUE_DEPTH, 5.0, 20.0),
        (ScalingSignal.QUEUE_WAIT, 0.05, 0.0),
        (ScalingSignal.CPU, 0.3, 0.0),
    ],
)
def test_each_signal_relieves_an_overload(signal, target, window_s):
    # 150 req/s on one replica of 100: the backlog grows until the autoscaler adds pods (and, with the
    # usual scale-down stabilization window, keeps them).
    fleet = autoscaled(1, signal, target, window_s=window_s, down_window_s=300.0)
    result = simulate(fleet, OpenLoad(Trace(90.0, (150.0,))), bin_s=5.0)
    assert max(b.replicas_ready for b in result.bins) >= 2
    early, late = result.bins[2], result.bins[-1]
    assert early.queue_depth > 100
    assert late.queue_depth < 5 and late.p99_s is not None and late.p99_s < 0.2
    assert result.window(0.0, 90.0).arrivals == result.status.size
    assert np.isnan(result.latency_s[result.status != 0]).all()
