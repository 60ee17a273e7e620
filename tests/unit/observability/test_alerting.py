"""The alert webhook without sockets: thresholds, rate limiting, message formats, delivery failures
(through httpx.MockTransport, a fake receiver in memory) and the background loop."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from pydantic import ValidationError

from fake_clock import FakeClock
from monitoring import alerts
from servewell.config.alerting import AlertingConfig, AlertThresholds
from servewell.observability.alerting import (
    RULES,
    WECOM_MAX_BYTES,
    ActiveAlerts,
    AlertEvaluator,
    AlertNotifier,
    SignalSnapshot,
    firing_alerts,
    render_payload,
    run_alerting,
)
from waiting import eventually_async

HEALTHY = SignalSnapshot("digits", p99_latency_s=0.05, error_ratio=0.0, rejected_ratio=0.0, queue_fill_ratio=0.1,
                         worker_restarts=0, memory_headroom_ratio=0.6)
URL = "https://hooks.example.test/services/T000/B000/secret-key"


def names(alerts) -> list[str]:
    return [a.name for a in alerts]


def test_a_healthy_snapshot_raises_nothing():
    assert firing_alerts(HEALTHY, AlertThresholds()) == []


def test_unknown_signals_never_fire():
    assert firing_alerts(SignalSnapshot("digits"), AlertThresholds()) == []


@pytest.mark.parametrize(("field", "at_limit", "past_limit", "alert"), [
    ("p99_latency_s", 0.5, 0.51, "latency_p99"),
    ("error_ratio", 0.05, 0.06, "error_ratio"),
    ("rejected_ratio", 0.01, 0.02, "rejected_ratio"),
    ("queue_fill_ratio", 0.8, 0.81, "queue_saturation"),
    ("memory_headroom_ratio", 0.1, 0.09, "memory_headroom"),
])
def test_each_signal_fires_only_past_its_threshold(field, at_limit, past_limit, alert):
    def with_value(value):
        return SignalSnapshot(**{**{f: getattr(HEALTHY, f) for f in HEALTHY.__dataclass_fields__}, field: value})

    assert firing_alerts(with_value(at_limit), AlertThresholds()) == []
    fired = firing_alerts(with_value(past_limit), AlertThresholds())
    assert names(fired) == [alert]
    assert fired[0].model == "digits" and fired[0].value == past_limit and fired[0].threshold == at_limit


def test_one_worker_restart_fires_by_default():
    fired = firing_alerts(SignalSnapshot("digits", worker_restarts=1), AlertThresholds())
    assert names(fired) == ["worker_restarts"]
    assert fired[0].severity == "warning"


def test_thresholds_come_from_the_config():
    config = AlertingConfig.model_validate({"webhook_url": URL, "thresholds": {"p99_latency_s": 2.0,
                                                                             "worker_restarts": 3}})
    snapshot = SignalSnapshot("digits", p99_latency_s=1.5, worker_restarts=2)
    assert firing_alerts(snapshot, config.thresholds) == []
    assert names(firing_alerts(SignalSnapshot("digits", p99_latency_s=2.5, worker_restarts=3),
                               config.thresholds)) == ["latency_p99", "worker_restarts"]


def test_every_alert_carries_a_concrete_action():
    snapshot = SignalSnapshot("digits", p99_latency_s=9, error_ratio=1, rejected_ratio=1, queue_fill_ratio=1,
                              worker_restarts=5, memory_headroom_ratio=0, rollback="canary version '2' failed")
    fired = firing_alerts(snapshot, AlertThresholds())
    assert len(fired) == len(RULES) == 7
    for alert in fired:
        assert "digits" in alert.summary
        assert "GET /" in alert.action or "POST /" in alert.action  # an endpoint to look at
    assert {a.name: a.severity for a in fired}["error_ratio"] == "critical"
    assert fired[0].summary == "digits: p99 latency 9000 ms over 500 ms"


ROLLBACK = ("canary version '2' failed 40.0% of 52 requests over the last 5 s against 0.0% of stable version '1' "
            "(allowed +10.0 points)")


def test_a_rollback_fires_critical_with_its_evidence_and_what_to_do():
    (alert,) = firing_alerts(SignalSnapshot("digits", error_ratio=0.0, rollback=ROLLBACK), AlertThresholds())
    assert (alert.name, alert.severity, alert.value, alert.threshold) == ("rollout_rolled_back", "critical", 1.0, 0.0)
    assert alert.summary == f"digits: rollout rolled back: {ROLLBACK}"  # the numbers reach the on-call
    assert "GET /admin/models/digits/rollout" in alert.action and "versions/<v>/" in alert.action
    assert 'PATCH /admin/models/digits/rollout with {"traffic": null}' in alert.action
    # It holds as long as the verdict stands, reminded at the webhook's interval like any other alert.
    evaluator = AlertEvaluator(AlertThresholds(), min_interval_s=600)
    standing = [SignalSnapshot("digits", rollback=ROLLBACK)]
    assert names(evaluator.evaluate(standing, 0.0)) == ["rollout_rolled_back"]
    assert evaluator.evaluate(standing, 599.0) == [] and len(evaluator.evaluate(standing, 600.0)) == 1


def test_a_rollout_that_is_not_rolled_back_fires_nothing():
    assert firing_alerts(SignalSnapshot("digits", rollback=None), AlertThresholds()) == []
    active = ActiveAlerts()
    active.update(firing_alerts(SignalSnapshot("digits", rollback=ROLLBACK), AlertThresholds()), 1.0)
    assert [a.prometheus for a in active.current()] == ["ServewellRolloutRolledBack"]
    active.update(firing_alerts(SignalSnapshot("digits"), AlertThresholds()), 2.0)  # weights set again
    assert active.current() == []


def test_rate_limit_per_alert_and_model():
    evaluator = AlertEvaluator(AlertThresholds(), min_interval_s=600)
    slow = SignalSnapshot("digits", p99_latency_s=1.0)
    assert names(evaluator.evaluate([slow], now=0.0)) == ["latency_p99"]
    assert evaluator.evaluate([slow], now=599.0) == []
    # another model, and another alert of the same model, are not held back
    both = [SignalSnapshot("digits", p99_latency_s=1.0, error_ratio=0.5), SignalSnapshot("other", p99_latency_s=1.0)]
    assert sorted((a.name, a.model) for a in evaluator.evaluate(both, now=600.0 - 1)) == [
        ("error_ratio", "digits"), ("latency_p99", "other")]
    # the condition persists: reminded once the interval has passed
    assert names(evaluator.evaluate([slow], now=600.0)) == ["latency_p99"]


def test_no_rate_limit_when_min_interval_is_zero():
    evaluator = AlertEvaluator(AlertThresholds(), min_interval_s=0)
    slow = [SignalSnapshot("digits", p99_latency_s=1.0)]
    assert len(evaluator.evaluate(slow, 0.0)) == len(evaluator.evaluate(slow, 0.0)) == 1


def sample_alerts():
    return firing_alerts(SignalSnapshot("digits", p99_latency_s=1.0, error_ratio=0.2), AlertThresholds())


def test_generic_payload_is_structured_json():
    body = render_payload(sample_alerts(), "generic", "prod-eu-1")
    assert body["source"] == "prod-eu-1"
    assert [a["name"] for a in body["alerts"]] == ["latency_p99", "error_ratio"]
    first = body["alerts"][0]
    assert set(first) == {"name", "model", "severity", "value", "threshold", "summary", "action"}
    assert first["value"] == 1.0 and first["threshold"] == 0.5
    json.dumps(body)  # serialisable as is


def test_slack_payload_is_a_text_message():
    body = render_payload(sample_alerts(), "slack", "servewell")
    assert set(body) == {"text"}
    assert "[CRITICAL] digits: 20.0% of requests fail with 5xx" in body["text"]
    assert "Action: " in body["text"] and "/healthz" in body["text"]


def test_wecom_payload_is_markdown_within_its_size_limit():
    body = render_payload(sample_alerts(), "wecom", "servewell")
    assert body["msgtype"] == "markdown"
    assert '<font color="warning">critical</font>' in body["markdown"]["content"]
    many = [a for i in range(200)
            for a in firing_alerts(SignalSnapshot(f"model-{i}", error_ratio=1.0), AlertThresholds())]
    content = render_payload(many, "wecom", "servewell")["markdown"]["content"]
    assert len(content.encode()) <= WECOM_MAX_BYTES and content.endswith("...")


def test_config_refuses_non_http_urls_and_hides_the_url():
    with pytest.raises(ValidationError):
        AlertingConfig(webhook_url="ftp://example.test/hook")
    with pytest.raises(ValidationError):
        AlertingConfig.model_validate({"webhook_url": URL, "fromat": "slack"})
    config = AlertingConfig(webhook_url=URL)
    assert "secret-key" not in repr(config) and "secret-key" not in str(config.model_dump())
    assert AlertingConfig().webhook_url is None


class Receiver:
    """A webhook receiver in memory: records bodies, answers what it is told to."""

    def __init__(self, answer=None) -> None:
        self.bodies: list[dict] = []
        self.urls: list[str] = []
        self.answer = answer or (lambda request: httpx.Response(200, text="ok"))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(str(request.url))
        self.bodies.append(json.loads(request.content))
        return self.answer(request)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self))


def send(config: AlertingConfig, receiver: Receiver, alerts) -> bool:
    async def main():
        async with receiver.client() as client:
            return await AlertNotifier(config, client).send(alerts)

    return asyncio.run(main())


def test_notifier_posts_the_rendered_payload():
    receiver = Receiver()
    assert send(AlertingConfig(webhook_url=URL, format="slack"), receiver, sample_alerts()) is True
    assert receiver.urls == [URL]
    assert set(receiver.bodies[0]) == {"text"}


def test_delivery_failures_are_logged_not_raised(caplog):
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    caplog.set_level(logging.WARNING, logger="servewell.alerting")
    config = AlertingConfig(webhook_url=URL)
    assert send(config, Receiver(refuse), sample_alerts()) is False
    assert send(config, Receiver(lambda r: httpx.Response(500)), sample_alerts()) is False
    messages = [r.getMessage() for r in caplog.records]
    assert any("ConnectError" in m for m in messages) and any("answered 500" in m for m in messages)
    assert all("secret-key" not in m for m in messages)  # only the host is logged


def test_wecom_refusal_in_a_200_answer_counts_as_failure(caplog):
    caplog.set_level(logging.WARNING, logger="servewell.alerting")
    config = AlertingConfig(webhook_url=URL, format="wecom")
    refused = Receiver(lambda r: httpx.Response(200, json={"errcode": 93000, "errmsg": "invalid webhook url"}))
    assert send(config, refused, sample_alerts()) is False
    assert "errcode 93000" in caplog.text
    accepted = Receiver(lambda r: httpx.Response(200, json={"errcode": 0, "errmsg": "ok"}))
    assert send(config, accepted, sample_alerts()) is True


def test_run_alerting_without_a_webhook_returns_at_once():
    asyncio.run(asyncio.wait_for(run_alerting(AlertingConfig(), lambda: [], asyncio.Event()), 1))


def test_run_alerting_notifies_rate_limited_and_survives_broken_snapshots(caplog):
    caplog.set_level(logging.WARNING, logger="servewell.alerting")
    receiver = Receiver()
    config = AlertingConfig(webhook_url=URL, evaluation_interval_s=0.005, min_interval_s=3600)
    rounds = 0

    def snapshots():
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise RuntimeError("metrics not ready")
        return [SignalSnapshot("digits", error_ratio=0.5)]

    async def main():
        stop = asyncio.Event()
        async with receiver.client() as client:
            task = asyncio.create_task(run_alerting(config, snapshots, stop, client=client))

            async def six_rounds() -> bool:
                return rounds >= 6

            await eventually_async(six_rounds, 10, "the alerting loop stopped")
            stop.set()
            await asyncio.wait_for(task, 1)

    asyncio.run(main())
    assert "could not be read" in caplog.text
    assert len(receiver.bodies) == 1  # five rounds fired, one notification within min_interval_s
    assert receiver.bodies[0]["alerts"][0]["name"] == "error_ratio"


# ---------- the server's own evaluation: active alerts (console, /healthz) ----------


def test_active_alerts_keep_their_start_while_firing_and_end_when_not():
    active, clock = ActiveAlerts(), FakeClock(1_700_000_000.0)
    thresholds = AlertThresholds()
    assert active.to_json() == [] and active.evaluated_at is None
    failing = SignalSnapshot("digits", error_ratio=0.5, queue_fill_ratio=0.9)
    active.update(firing_alerts(failing, thresholds), clock.now())
    started = clock.now()
    clock.advance(15)
    active.update(firing_alerts(SignalSnapshot("digits", error_ratio=0.7, queue_fill_ratio=0.9), thresholds),
                  clock.now())
    (error, queue) = active.to_json()  # critical first
    assert (error["name"], error["prometheus"], error["severity"]) == ("error_ratio", "ServewellHighErrorRatio",
                                                                       "critical")
    assert error["since"] == started and error["value"] == 0.7 and error["threshold"] == 0.05
    assert "digits" in error["summary"] and error["action"] and active.evaluated_at == clock.now()
    assert queue["name"] == "queue_saturation"
    clock.advance(15)
    active.update(firing_alerts(SignalSnapshot("digits", error_ratio=0.0, queue_fill_ratio=0.9), thresholds),
                  clock.now())
    assert names(active.current()) == ["queue_saturation"]
    clock.advance(15)
    active.update(firing_alerts(HEALTHY, thresholds), clock.now())  # resolved
    assert active.current() == []
    active.update(firing_alerts(failing, thresholds), clock.now())  # a new episode starts anew
    assert active.current()[0].since == clock.now()


def test_run_alerting_without_a_webhook_still_keeps_the_active_alerts():
    active = ActiveAlerts()
    config = AlertingConfig(evaluation_interval_s=0.005)
    clock = FakeClock(1_700_000_000.0)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(run_alerting(config, lambda: [SignalSnapshot("digits", error_ratio=0.5)], stop,
                                                active=active, wall_clock=clock.now))

        async def evaluated() -> bool:
            return bool(active.current())

        await eventually_async(evaluated, 10, "no evaluation without a webhook")
        stop.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(main())
    assert names(active.current()) == ["error_ratio"] and active.current()[0].since == clock.now()


def test_every_rule_mirrors_an_alert_of_the_prometheus_rules():
    assert {rule.prometheus for rule in RULES} <= {alert["alert"] for alert in alerts()}
    assert len({rule.prometheus for rule in RULES}) == len(RULES)
