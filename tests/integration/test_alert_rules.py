"""The monitoring files in deploy/: Prometheus rules checked and unit-tested by promtool (a
subprocess), and the Grafana dashboard checked against servewell's metric names and the alerts.

promtool comes with Debian's `prometheus` package, which .ci/run installs; without it these tests
fail rather than skip, so a CI machine that lacks it cannot pass silently.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "servewell-dashboard.json"

#: Metric families servewell exposes at /metrics (observability/metrics.py), by type.
HISTOGRAMS = (
    "servewell_request_duration_seconds", "servewell_queue_wait_seconds", "servewell_preprocess_seconds",
    "servewell_batch_compute_seconds", "servewell_batch_transport_seconds", "servewell_postprocess_seconds",
    "servewell_batch_size", "servewell_trace_step_seconds",
)
COUNTERS = ("servewell_requests", "servewell_model_loads", "servewell_worker_restarts")
GAUGES = (
    "servewell_queue_depth", "servewell_inflight_requests", "servewell_model_state", "servewell_worker_up",
    "servewell_effective_max_batch_size", "servewell_worker_resident_memory_bytes",
    "servewell_worker_private_memory_bytes", "servewell_worker_mapped_file_memory_bytes", "servewell_worker_cpu_seconds",
    "servewell_worker_threads", "servewell_memory_budget_bytes", "servewell_ready",
)
GPU_GAUGES = (
    "servewell_gpu_utilization_ratio", "servewell_gpu_memory_used_bytes", "servewell_gpu_memory_total_bytes",
    "servewell_gpu_power_watts", "servewell_gpu_temperature_celsius",
)
#: Series names as Prometheus stores them.
SERIES = frozenset(
    [f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")]
    + [f"{c}_total" for c in COUNTERS] + list(GAUGES) + list(GPU_GAUGES)
)
METRIC_NAME = re.compile(r"\bservewell_[a-z0-9_]+")
RECORDED_NAME = re.compile(r"\bservewell:[a-z0-9_:]+")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: .ci/run installs it (Debian package `prometheus`); "
                    "locally: sudo apt-get install prometheus")
    return path


def run_promtool(*args: str) -> str:
    result = subprocess.run([promtool(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_promtool_checks_the_rules():
    assert "SUCCESS" in run_promtool("check", "rules", "deploy/prometheus/alerts.yml")


def test_promtool_unit_tests_of_the_rules_pass():
    assert "SUCCESS" in run_promtool("test", "rules", "deploy/prometheus/alerts_test.yml")


def test_promtool_checks_the_example_config():
    assert "SUCCESS" in run_promtool("check", "config", "deploy/prometheus/prometheus.yml")


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def test_every_alert_has_severity_summary_description_and_action():
    assert len(alerts()) >= 10
    for alert in alerts():
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert {"summary", "description", "action"} <= set(alert["annotations"]), alert["alert"]


def test_every_alert_is_unit_tested_firing():
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case["exp_alerts"]}
    assert fired == {alert["alert"] for alert in alerts()}


def test_rules_use_only_exposed_metrics_and_recorded_names():
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        assert set(METRIC_NAME.findall(rule["expr"])) <= SERIES, rule
        assert set(RECORDED_NAME.findall(rule["expr"])) <= recorded, rule


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_has_what_grafana_needs_to_import_it():
    doc = dashboard()
    assert doc["uid"] == "servewell" and doc["title"] and 36 <= doc["schemaVersion"] <= 41
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query"
    assert variables["model"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_panels_do_not_overlap():
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def test_every_panel_queries_the_templated_datasource_with_exposed_metrics():
    defined = {f"${v['name']}" for v in dashboard()["templating"]["list"]} | {"$__rate_interval", "$__range"}
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            names = set(METRIC_NAME.findall(expr))
            assert names, f"{panel['title']}: no servewell metric in {expr}"
            assert names <= SERIES, f"{panel['title']}: unknown metrics {names - SERIES}"
            assert set(re.findall(r"\$[a-z_]+", expr)) <= defined, f"{panel['title']}: undefined variable in {expr}"
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_dashboard_covers_every_signal():
    used = {name for panel in panels() for t in panel["targets"] for name in METRIC_NAME.findall(t["expr"])}
    families = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in used}
    assert set(HISTOGRAMS) | set(COUNTERS) | set(GAUGES) | set(GPU_GAUGES) <= families


def test_panels_named_in_alert_actions_exist():
    """Actions quote dashboard panels by title ("Queue depth per lane"); quoted log excerpts hold '...'."""
    titles = {p["title"] for p in panels()}
    for alert in alerts():
        for quoted in re.findall(r'"([^"]+)"', alert["annotations"]["action"]):
            if "..." not in quoted:
                assert quoted in titles, f"{alert['alert']} names a panel that does not exist: {quoted!r}"
