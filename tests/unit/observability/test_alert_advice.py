"""Every alert's advice follows the model's diagnosis (observability/alerting.py): with a cause found
before capacity, the latency, error, refusal and queue alerts give that cause's advice and evidence,
never "add throughput"; without one, their own capacity advice, saying nothing earlier was found."""

from __future__ import annotations

from servewell.config.alerting import AlertThresholds
from servewell.observability.alerting import SignalSnapshot, firing_alerts
from servewell.observability.diagnosis import Diagnosis

FLOOD = Diagnosis("tenant_holds_lane", "one tenant fills the queue: 'alpha' holds most of lane 'normal'",
                  ("tenant 'alpha' holds 45 of 48 queued places",), "limit tenant 'alpha': PATCH /admin/tenants/alpha")
CAPACITY = Diagnosis("capacity", "queue wait dominates: capacity", ("p99 400 ms",), "add throughput")


def test_a_diagnosed_cause_replaces_the_capacity_advice_of_every_symptom_alert() -> None:
    snapshot = SignalSnapshot("digits", p99_latency_s=2.0, error_ratio=0.2, rejected_ratio=0.3,
                              queue_fill_ratio=0.95, diagnosis=FLOOD)
    alerts = {a.name: a for a in firing_alerts(snapshot, AlertThresholds())}
    assert set(alerts) == {"latency_p99", "error_ratio", "rejected_ratio", "queue_saturation"}
    for alert in alerts.values():
        assert alert.action.startswith("limit tenant 'alpha': PATCH /admin/tenants/alpha")
        assert "45 of 48 queued places" in alert.action and "Capacity is not the cause" in alert.action
        assert "raise `instances`" not in alert.action and "Add throughput" not in alert.action
        assert alert.summary.endswith("'alpha' holds most of lane 'normal'")


def test_without_an_earlier_cause_the_alerts_keep_their_own_advice() -> None:
    snapshot = SignalSnapshot("digits", rejected_ratio=0.3, diagnosis=CAPACITY)
    (alert,) = firing_alerts(snapshot, AlertThresholds())
    assert "add throughput" in alert.action and "no earlier cause was found" in alert.action


def test_a_memory_replacement_fires_the_restart_alert_with_its_cause() -> None:
    replaced = Diagnosis("worker_replaced", "worker replaced (memory): the gap of the replacement",
                         ("1 replacement in the last 30 s (1 for memory)",), "look for a leak")
    (alert,) = firing_alerts(SignalSnapshot("digits", worker_restarts=1, diagnosis=replaced), AlertThresholds())
    assert alert.name == "worker_restarts" and alert.action.startswith("look for a leak")
