"""Golden-signal alerts evaluated by the server itself: snapshots in, active alerts and (optional)
webhook notifications out.

Prometheus with deploy/prometheus/alerts.yml is the fleet's alerting path; this one lets a single
server without Prometheus say that it is in trouble: the active alerts are always kept (the console's
"Active alerts" panel and `/healthz` show them), and a webhook, when configured, delivers them.
Each rule names the alerts.yml alert it mirrors (`AlertRule.prometheus`). It has four parts:

- `AlertEvaluator` is pure and synchronous: `SignalSnapshot`s and a clock reading in, the alerts due
  out (thresholds from `AlertThresholds`, at most one notification per alert and model per
  `min_interval_s`), so it is tested without sockets or sleeps.
- `AlertNotifier` renders alerts for a generic JSON receiver, Slack or WeCom and POSTs them with
  `httpx.AsyncClient`; a failed POST is logged at warning and never raised.
- `ActiveAlerts` keeps which alerts hold now, since when, for the console and `/healthz`.
- `run_alerting` ties them together in a background task of the server.

The webhook URL is a secret (chat webhooks embed their key): it is held as `SecretStr` and only its
host is ever logged.

Advice follows the model's diagnosis (`diagnosis.py`): when the server has found a cause that comes
before capacity in the reading order (one tenant holding most of a lane, a cache TTL shorter than
its inputs' reuse interval, a worker replacement's gap, host CPU contention), the latency, error,
refusal and queue alerts give that cause's advice with its evidence, never "add throughput"
(`AlertRule.follows_diagnosis`); deploy/prometheus/alerts.yml does the same from
`servewell_diagnosis{model,cause}`.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from servewell.config.alerting import AlertFormat, AlertingConfig, AlertThresholds
from servewell.observability.diagnosis import Diagnosis

log = logging.getLogger("servewell.alerting")

Severity = Literal["warning", "critical"]

#: WeCom refuses markdown content over 4096 bytes.
WECOM_MAX_BYTES = 4096


@dataclass(slots=True, frozen=True)
class SignalSnapshot:
    """Golden signals of one model over the producer's recent window; None where not known
    (no traffic yet, no memory limit set), which never fires."""

    model: str
    p99_latency_s: float | None = None
    error_ratio: float | None = None
    rejected_ratio: float | None = None
    queue_fill_ratio: float | None = None
    worker_restarts: int = 0
    memory_headroom_ratio: float | None = None
    rollback: str | None = None  # why the model's rollout stands rolled back, with the numbers; None: it does not
    diagnosis: Diagnosis | None = None  # the model's latest reading (observability/diagnosis.py)


@dataclass(slots=True, frozen=True)
class Alert:
    """One alert due for notification."""

    name: str
    model: str
    severity: Severity
    value: float
    threshold: float
    summary: str
    action: str


@dataclass(slots=True, frozen=True)
class AlertRule:
    """How one signal of a snapshot turns into an alert."""

    name: str
    prometheus: str  # the alert of deploy/prometheus/alerts.yml this rule mirrors
    severity: Severity
    read: Callable[[SignalSnapshot], float | None]
    limit: Callable[[AlertThresholds], float]
    breached: Callable[[float, float], bool]  # (value, limit) -> fires
    show: Callable[[float], str]
    summary: str  # format fields: model, value, threshold
    action: str  # format field: model
    detail: Callable[[SignalSnapshot], str | None] | None = None  # evidence appended to the summary
    #: A diagnosed cause before capacity replaces `action` with the cause's advice, and the summary
    #: names the reading (the capacity advice would be wrong then).
    follows_diagnosis: bool = False


def _rolled_back(snapshot: SignalSnapshot) -> float | None:
    return 1.0 if snapshot.rollback is not None else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


RULES: tuple[AlertRule, ...] = (
    AlertRule(
        "latency_p99", "ServewellLatencyP99OverSLO",
        "warning", lambda s: s.p99_latency_s, lambda t: t.p99_latency_s, operator.gt, _ms,
        "{model}: p99 latency {value} over {threshold}",
        "The server's reading found no cause before capacity (no tenant holding most of a lane, no short cache "
        "TTL, no worker replacement, no CPU contention). Find the stage that grew (dashboard 'Latency by stage "
        "(p95)'): queue wait -> raise `instances` in model.yaml and POST /v2/repository/models/{model}/load, or "
        "lower `batching.max_wait_ms`; compute -> lower `max_batch_size` (PATCH /admin/models/{model}/batching) "
        "or use a GPU / fp16; preprocess -> raise `decode_threads`.",
        follows_diagnosis=True,
    ),
    AlertRule(
        "error_ratio", "ServewellHighErrorRatio",
        "critical", lambda s: s.error_ratio, lambda t: t.error_ratio, operator.gt, _pct,
        "{model}: {value} of requests fail with 5xx (threshold {threshold})",
        "GET /healthz (models.{model}.state, reason, instances[].alive) and the server log lines with "
        "model={model}; if a new version was just loaded, restore the previous directory and POST "
        "/v2/repository/models/{model}/load.",
        follows_diagnosis=True,
    ),
    AlertRule(
        "rejected_ratio", "ServewellRequestsRejected",
        "warning", lambda s: s.rejected_ratio, lambda t: t.rejected_ratio, operator.gt, _pct,
        "{model}: {value} of requests refused, queue full (threshold {threshold})",
        "No tenant holds most of the lane and no earlier cause was found: add throughput: raise `instances` in "
        "model.yaml (then POST /v2/repository/models/{model}/load) or `max_batch_size` (PATCH "
        "/admin/models/{model}/batching); raise `batching.max_queue_size` only if the latency SLO allows longer "
        "waits.",
        follows_diagnosis=True,
    ),
    AlertRule(
        "queue_saturation", "ServewellQueueSaturated",
        "warning", lambda s: s.queue_fill_ratio, lambda t: t.queue_fill_ratio, operator.gt, _pct,
        "{model}: queue {value} full (threshold {threshold})",
        "GET /admin/models/{model}/batching for the live `max_queue_size`; no earlier cause was found: add "
        "`instances` or raise `max_batch_size` before requests are refused with 503.",
        follows_diagnosis=True,
    ),
    AlertRule(
        "worker_restarts", "ServewellWorkerRestarts",
        "warning", lambda s: float(s.worker_restarts), lambda t: float(t.worker_restarts),
        operator.ge, lambda v: f"{v:.0f}",
        "{model}: {value} worker restart(s)",
        "GET /healthz (models.{model}.restarts_by_reason and replacements: each with its cause and the gap it "
        "caused) and the log line 'worker ... replaced'; memory: the worker passed `host_memory_limit_bytes` "
        "(look for a leak in its memory series, or raise the limit); crash: its exit in last_failure; hung: a "
        "stuck batch. With one instance the gap is a wait for every request of the model.",
        follows_diagnosis=True,
    ),
    AlertRule(
        "memory_headroom", "ServewellWorkerMemoryHigh",
        "critical", lambda s: s.memory_headroom_ratio, lambda t: t.memory_headroom_ratio,
        operator.lt, _pct,
        "{model}: only {value} memory headroom left (threshold {threshold})",
        "GET /healthz (rss_bytes, memory_budget); set or raise `host_memory_limit_bytes` in model.yaml, lower "
        "`instances` or `max_batch_size`, or unload unused models (POST /v2/repository/models/NAME/unload).",
    ),
    # Holds from the rollback until model.yaml's traffic changes or an admin sets weights (engine/rollout.py);
    # no threshold: the rollout's own rules (model.yaml's rollout.rollback) decided.
    AlertRule(
        "rollout_rolled_back", "ServewellRolloutRolledBack",
        "critical", _rolled_back, lambda t: 0.0, operator.gt, lambda v: f"{v:.0f}",
        "{model}: rollout rolled back",
        "GET /admin/models/{model}/rollout for the evidence (each version's window, the rule, the shadow's "
        "agreement); fix or remove the bad version under versions/<v>/ of the model's directory, then set "
        "`traffic` in its model.yaml, or PATCH /admin/models/{model}/rollout with {{\"traffic\": null}} to return "
        "to the file's weights.",
        detail=lambda s: s.rollback,
    ),
)


def firing_alerts(snapshot: SignalSnapshot, thresholds: AlertThresholds) -> list[Alert]:
    """Every alert whose condition holds in `snapshot`, without rate limiting."""
    alerts = []
    for rule in RULES:
        value = rule.read(snapshot)
        if value is None:
            continue
        limit = rule.limit(thresholds)
        if rule.breached(value, limit):
            summary = rule.summary.format(model=snapshot.model, value=rule.show(value), threshold=rule.show(limit))
            detail = rule.detail(snapshot) if rule.detail is not None else None
            action = rule.action.format(model=snapshot.model)
            diagnosis = snapshot.diagnosis
            if rule.follows_diagnosis and diagnosis is not None and diagnosis.found:
                detail = "; ".join(part for part in (detail, diagnosis.reading) if part)
                action = (f"{diagnosis.advice} (evidence: {'; '.join(diagnosis.evidence)}). Capacity is not the "
                          "cause: the server's reading order put this first.")
            alerts.append(Alert(
                name=rule.name, model=snapshot.model, severity=rule.severity, value=value, threshold=limit,
                summary=f"{summary}: {detail}" if detail else summary, action=action,
            ))
    return alerts


class AlertEvaluator:
    """Decides which alerts to notify now: those firing, at most once per alert and model per
    `min_interval_s` (a condition that persists is repeated at that interval as a reminder)."""

    def __init__(self, thresholds: AlertThresholds, min_interval_s: float) -> None:
        self.thresholds = thresholds
        self.min_interval_s = min_interval_s
        self._last_sent_at: dict[tuple[str, str], float] = {}

    def evaluate(self, snapshots: Iterable[SignalSnapshot], now: float) -> list[Alert]:
        """Alerts due at monotonic time `now`; they count as sent whether or not delivery succeeds,
        so a broken webhook is not hammered."""
        return self.due([a for s in snapshots for a in firing_alerts(s, self.thresholds)], now)

    def due(self, firing: Iterable[Alert], now: float) -> list[Alert]:
        """Of the `firing` alerts, those to notify at monotonic time `now` (see `evaluate`)."""
        due = []
        for alert in firing:
            key = (alert.name, alert.model)
            last = self._last_sent_at.get(key)
            if last is not None and now - last < self.min_interval_s:
                continue
            self._last_sent_at[key] = now
            due.append(alert)
        return due


@dataclass(slots=True, frozen=True)
class ActiveAlert:
    """An alert that holds now: what fired, since when (Unix time of the first evaluation that
    saw it), its latest value and what to do."""

    name: str
    prometheus: str
    model: str
    severity: Severity
    since: float
    value: float
    threshold: float
    summary: str
    action: str


_PROMETHEUS_NAME = {rule.name: rule.prometheus for rule in RULES}


class ActiveAlerts:
    """The alerts holding after the latest evaluation. An alert stays active while every evaluation
    finds it firing and ends at the first that does not (below its threshold, or no traffic to
    judge), as a Prometheus rule without `for:` does. Updated and read on the event loop only."""

    def __init__(self) -> None:
        self._active: dict[tuple[str, str], ActiveAlert] = {}
        self.evaluated_at: float | None = None  # Unix time of the latest evaluation; None before the first

    def update(self, firing: Iterable[Alert], now: float) -> None:
        """Replace the set with `firing`, evaluated at Unix time `now`; an alert that was already
        active keeps its `since`."""
        active: dict[tuple[str, str], ActiveAlert] = {}
        for alert in firing:
            key = (alert.name, alert.model)
            before = self._active.get(key)
            active[key] = ActiveAlert(alert.name, _PROMETHEUS_NAME.get(alert.name, ""), alert.model, alert.severity,
                                      before.since if before is not None else now, alert.value, alert.threshold,
                                      alert.summary, alert.action)
        self._active = active
        self.evaluated_at = now

    def current(self) -> list[ActiveAlert]:
        """Active alerts, critical first, then the oldest first."""
        return sorted(self._active.values(), key=lambda a: (a.severity != "critical", a.since, a.name, a.model))

    def to_json(self) -> list[dict[str, Any]]:
        """`current()` as JSON-ready dicts (the shape of `/healthz`'s and the console's `alerts`)."""
        return [asdict(a) for a in self.current()]


def render_payload(alerts: Sequence[Alert], fmt: AlertFormat, source: str) -> dict[str, Any]:
    """The JSON body of one notification carrying `alerts`, in the receiver's format."""
    if fmt == "generic":
        return {"source": source, "alerts": [asdict(a) for a in alerts]}
    if fmt == "slack":
        lines = [f"*{source}: {len(alerts)} alert(s)*"]
        for a in alerts:
            lines.append(f"[{a.severity.upper()}] {a.summary}\n> Action: {a.action}")
        return {"text": "\n".join(lines)}
    lines = [f"**{source}: {len(alerts)} alert(s)**"]
    for a in alerts:
        color = "warning" if a.severity == "critical" else "comment"  # WeCom's only colours: info, comment, warning
        lines.append(f'> <font color="{color}">{a.severity}</font> {a.summary}\n> Action: {a.action}')
    content = "\n".join(lines)
    encoded = content.encode()
    if len(encoded) > WECOM_MAX_BYTES:
        content = encoded[: WECOM_MAX_BYTES - 3].decode(errors="ignore") + "..."
    return {"msgtype": "markdown", "markdown": {"content": content}}


class AlertNotifier:
    """POSTs rendered alerts to the configured webhook; never raises on delivery problems."""

    def __init__(self, config: AlertingConfig, client: httpx.AsyncClient) -> None:
        if config.webhook_url is None:
            raise ValueError("AlertNotifier needs a webhook_url")
        self._url = config.webhook_url.get_secret_value()
        self._host = urlsplit(self._url).hostname
        self._format: AlertFormat = config.format
        self._source = config.source
        self._timeout_s = config.timeout_s
        self._client = client

    async def send(self, alerts: Sequence[Alert]) -> bool:
        """POST one notification with `alerts`; True when the receiver accepted it."""
        if not alerts:
            return True
        body = render_payload(alerts, self._format, self._source)
        try:
            response = await self._client.post(self._url, json=body, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            log.warning("alert webhook at %s failed: %s: %s", self._host, type(exc).__name__, exc)
            return False
        if response.status_code >= 300:
            log.warning("alert webhook at %s answered %d", self._host, response.status_code)
            return False
        refusal = _wecom_error(response) if self._format == "wecom" else None
        if refusal is not None:
            log.warning("alert webhook at %s refused the message: %s", self._host, refusal)
            return False
        return True


def _wecom_error(response: httpx.Response) -> str | None:
    # WeCom answers 200 with {"errcode": N, "errmsg": ...}; N != 0 means the message was refused.
    try:
        doc = response.json()
    except ValueError:
        return None
    if isinstance(doc, dict) and doc.get("errcode", 0) != 0:
        return f"errcode {doc.get('errcode')}: {doc.get('errmsg', '')}"
    return None


SnapshotFn = Callable[[], Sequence[SignalSnapshot]]


async def run_alerting(
    config: AlertingConfig,
    snapshot_fn: SnapshotFn,
    stop_event: asyncio.Event,
    *,
    active: ActiveAlerts | None = None,
    client: httpx.AsyncClient | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    refresh: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Every `evaluation_interval_s` until `stop_event` is set: take snapshots, keep the alerts that
    hold in `active`, and notify the alerts due when a webhook is configured.

    `snapshot_fn` runs on the event loop, so it must be cheap and must not block (read counters, no
    I/O); an exception from it is logged and that round skipped. The first evaluation comes one
    interval after the start. Returns at once when there is neither a webhook nor an `active` set to
    keep. A `client` passed in is used and left open; otherwise one is made and closed here.
    `refresh` (the console feed's `view.refresh`: absorb what ingress processes counted) is awaited
    before each evaluation; it never raises and waits at most its timeout.
    """
    if config.webhook_url is None and active is None:
        return
    evaluator = AlertEvaluator(config.thresholds, config.min_interval_s)
    http: httpx.AsyncClient | None = None
    own_client = client is None and config.webhook_url is not None
    if config.webhook_url is not None:
        http = client if client is not None else httpx.AsyncClient(timeout=config.timeout_s)
    notifier = AlertNotifier(config, http) if http is not None else None
    try:
        while True:
            try:
                await asyncio.wait_for(stop_event.wait(), config.evaluation_interval_s)
                return
            except TimeoutError:
                pass
            if refresh is not None:
                await refresh()
            try:
                snapshots = snapshot_fn()
            except Exception:  # a broken producer must not end alerting
                log.warning("alert signals could not be read; skipping this evaluation", exc_info=True)
                continue
            firing = [a for s in snapshots for a in firing_alerts(s, config.thresholds)]
            if active is not None:
                active.update(firing, wall_clock())
            if notifier is not None:
                due = evaluator.due(firing, clock())
                if due:
                    await notifier.send(due)
    finally:
        if own_client and http is not None:
            await http.aclose()
