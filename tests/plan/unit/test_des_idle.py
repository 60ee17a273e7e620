"""What a request costs when it finds its replica idle (`ReplicaModel.idle_cost`): the table is
interpolated, its CPU is work on the front and its delay is latency only, and a busy replica never
pays it."""

from __future__ import annotations

from typing import Any

import pytest

from servewell_plan.des import ClosedLoad, simulate
from servewell_plan.model import FleetSpec, ReplicaModel

#: After 10 ms idle: 2 ms more CPU and 1 ms more delay; after 30 ms: 4 ms and 3 ms, and no more.
TABLE = ((0.01, 0.002, 0.001), (0.03, 0.004, 0.003))
FRONT_S, BATCH_S = 0.001, 0.002


def replica(**overrides: Any) -> ReplicaModel:
    settings: dict[str, Any] = {"front_s": FRONT_S, "alpha_s": 0.0, "beta_s": BATCH_S, "idle_cost": TABLE}
    return ReplicaModel(**(settings | overrides))


def test_the_table_is_linear_between_its_points_zero_at_zero_and_flat_after_the_last():
    r = replica()
    assert r.idle_extra(0.0) == (0.0, 0.0)
    assert r.idle_extra(0.005) == pytest.approx((0.001, 0.0005))
    assert r.idle_extra(0.02) == pytest.approx((0.003, 0.002))
    assert r.idle_extra(5.0) == pytest.approx((0.004, 0.003))
    assert replica(idle_cost=()).idle_extra(5.0) == (0.0, 0.0)


@pytest.mark.parametrize(("think_s", "cpu_s", "delay_s"), [(0.0, 0.0, 0.0), (0.02, 0.003, 0.002),
                                                          (0.1, 0.004, 0.003)])
def test_one_client_that_thinks_pays_the_idle_cost_of_its_think_time(think_s, cpu_s, delay_s):
    result = simulate(FleetSpec(replica(), 1), ClosedLoad(1, 20.0, think_s=think_s))
    stats = result.window(1.0, 20.0)
    # the replica is idle from each answer to the next request: exactly the think time
    assert stats.p50_s == pytest.approx(FRONT_S + BATCH_S + cpu_s + delay_s, abs=1e-9)
    assert result.cpu_per_answer_s == pytest.approx(FRONT_S + BATCH_S + cpu_s, rel=0.01)


def test_a_replica_kept_busy_never_pays_it():
    busy = simulate(FleetSpec(replica(), 1), ClosedLoad(4, 10.0)).window(1.0, 10.0)
    plain = simulate(FleetSpec(replica(idle_cost=()), 1), ClosedLoad(4, 10.0)).window(1.0, 10.0)
    assert busy.throughput_rps == pytest.approx(plain.throughput_rps, rel=1e-6)
    assert busy.p50_s == pytest.approx(plain.p50_s, rel=1e-6)


def test_the_idle_cpu_is_work_on_a_shared_node_and_the_delay_is_not():
    # one core shared with a load generator that is busy 4 ms per request: the idle CPU waits for it
    node = {"node_cores": 1.0, "client_cpu_s": 0.004}
    cpu = simulate(FleetSpec(replica(), 1, **node), ClosedLoad(1, 20.0, think_s=0.1))
    delay = simulate(FleetSpec(replica(idle_cost=((0.03, 0.0, 0.007),)), 1, **node), ClosedLoad(1, 20.0, think_s=0.1))
    assert cpu.cpu_per_answer_s == pytest.approx(delay.cpu_per_answer_s + 0.004, rel=0.01)
