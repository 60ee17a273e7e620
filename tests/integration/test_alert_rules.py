"""The monitoring files in deploy/: Prometheus rules checked and unit-tested by promtool (a
subprocess), and the Grafana dashboard checked against servewell's metric names and the alerts.

promtool comes with Debian's `prometheus` package, which `make test` installs
(scripts/install-test-deps.sh); without it these tests fail rather than skip, so a machine that
lacks it cannot pass silently.
"""

from __future__ import annotations

import re
import subprocess

import yaml

from monitoring import (
    COUNTERS,
    GAUGES,
    GPU_GAUGES,
    HISTOGRAMS,
    METRIC_NAME,
    PIPELINE_FAMILIES,
    POOL_FAMILIES,
    PROMETHEUS_DIR,
    RECORDED_NAME,
    ROLLOUT_FAMILIES,
    ROOT,
    SERIES,
    TENANT_CACHE_FAMILIES,
    alerts,
    dashboard,
    panels,
    rules,
)
from processes import require_program


def run_promtool(*args: str) -> str:
    promtool = require_program("promtool", "prometheus")
    result = subprocess.run([promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_promtool_checks_the_rules():
    assert "SUCCESS" in run_promtool("check", "rules", "deploy/prometheus/alerts.yml")


def test_promtool_unit_tests_of_the_rules_pass():
    assert "SUCCESS" in run_promtool("test", "rules", "deploy/prometheus/alerts_test.yml")


def test_promtool_checks_the_example_config():
    assert "SUCCESS" in run_promtool("check", "config", "deploy/prometheus/prometheus.yml")


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
    def family(name: str) -> str:
        return re.sub(r"_(bucket|sum|count|total)$", "", name)

    families = {family(name) for name in used}
    assert set(HISTOGRAMS) | set(COUNTERS) | set(GAUGES) | set(GPU_GAUGES) <= families
    assert {family(name) for name in POOL_FAMILIES} <= families
    assert {family(name) for name in TENANT_CACHE_FAMILIES} <= families
    assert {family(name) for name in PIPELINE_FAMILIES} <= families
    assert {family(name) for name in ROLLOUT_FAMILIES} <= families


def test_panels_named_in_alert_actions_exist():
    """Actions quote dashboard panels by title ("Queue depth per lane"); quoted log excerpts hold '...'."""
    titles = {p["title"] for p in panels()}
    for alert in alerts():
        for quoted in re.findall(r'"([^"]+)"', alert["annotations"]["action"]):
            if "..." not in quoted:
                assert quoted in titles, f"{alert['alert']} names a panel that does not exist: {quoted!r}"
