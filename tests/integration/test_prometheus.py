"""A real Prometheus scraping a real servewell with deploy/prometheus's config and rules: the data
arrives, the rules load and evaluate without error, a healthy server fires nothing, and every
dashboard query parses and the core panels have data.

Needs `prometheus` on PATH (Debian package `prometheus`, installed by `make test`); the test
fails without it. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
import yaml

from model_dirs import onnx_linear_model
from monitoring import DASHBOARD, GAUGES, PROMETHEUS_DIR, SERIES, alerts
from processes import ChildProcess, free_port, require_program
from servers import ServerProcess
from waiting import eventually

MODEL = "tiny"
BODY = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
BAD_BODY = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
SCRAPE_INTERVAL = "1s"


def prometheus_config(servewell_port: int) -> dict:
    """deploy/prometheus/prometheus.yml, scraping every second the servewell under test."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL)
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{servewell_port}"]}]
    return config


class PrometheusApi:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params) -> dict:
        response = httpx.get(self.url + path, params=params, timeout=10)
        doc = response.json()
        assert doc["status"] == "success", f"{path} {params}: {doc}"
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait_for(self, expr: str, timeout_s: float = 60) -> list[dict]:
        return eventually(lambda: self.query(expr), timeout_s, f"no data for {expr}", interval_s=0.5)


def send_load(url: str, stop: threading.Event) -> None:
    """Steady traffic, mostly good: one request in ten is malformed (400)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        i = 0
        while not stop.is_set():
            body = BAD_BODY if i % 10 == 9 else BODY
            client.post(f"/v2/models/{MODEL}/infer", json=body)
            i += 1
            stop.wait(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusApi]:
    prometheus = require_program("prometheus", "prometheus")
    root = tmp_path_factory.mktemp("prometheus-stack")
    onnx_linear_model(root / "repo", MODEL)
    prom_port = free_port()
    started: list[ChildProcess] = []
    stop_load = threading.Event()
    load: threading.Thread | None = None
    try:
        server = ServerProcess(["--model-repository", str(root / "repo")], root / "servewell.log")
        started.append(server)
        server.wait_ready()
        serve_url = server.url
        for _ in range(50):
            assert httpx.post(f"{serve_url}/v2/models/{MODEL}/infer", json=BODY, timeout=30).status_code == 200

        config_path = root / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(prometheus_config(server.port)))
        prom = ChildProcess([prometheus, f"--config.file={config_path}", f"--storage.tsdb.path={root / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], root / "prometheus.log")
        started.append(prom)
        prom_url = f"http://127.0.0.1:{prom_port}"
        prom.wait_http_ok(prom_url + "/-/ready", 60)
        api = PrometheusApi(prom_url)
        api.wait_for('up{job="servewell"} == 1', 30)
        # rates need the counters to move between scrapes: keep traffic going while Prometheus watches
        load = threading.Thread(target=send_load, args=(serve_url, stop_load), daemon=True)
        load.start()
        yield api
    finally:
        stop_load.set()
        if load is not None:
            load.join(30)
        for process in reversed(started):
            process.stop()


def test_request_rate_and_latency_quantile_arrive(stack: PrometheusApi):
    rate = stack.wait_for("sum(rate(servewell_request_duration_seconds_count[30s])) > 0")
    assert float(rate[0]["value"][1]) > 0
    p99 = stack.wait_for("histogram_quantile(0.99, sum by (le) "
                         "(rate(servewell_request_duration_seconds_bucket[30s]))) >= 0")
    assert 0 <= float(p99[0]["value"][1]) < 5
    stack.wait_for(f'servewell_request_duration_seconds_count{{model="{MODEL}", status_class="4xx"}} > 0')


def test_servewell_exposes_the_metrics_the_rules_and_dashboard_use(stack: PrometheusApi):
    stack.wait_for(f'servewell_batch_size_count{{model="{MODEL}"}} > 0')
    names = {n for n in stack.get("/api/v1/label/__name__/values")
             if n.startswith("servewell_") and not n.endswith("_created")}  # prometheus_client's creation times
    expected = {f"{h}_count" for h in ("servewell_request_duration_seconds", "servewell_queue_wait_seconds",
                                        "servewell_batch_compute_seconds", "servewell_batch_transport_seconds",
                                        "servewell_batch_size")}
    expected |= {"servewell_requests_total", "servewell_model_loads_total"} | set(GAUGES)
    assert expected <= names, f"missing from /metrics: {sorted(expected - names)}"
    assert names <= SERIES, f"exposed but unknown to rules and dashboard: {sorted(names - SERIES)}"


def test_worker_index_is_labelled_worker(stack: PrometheusApi):
    (up,) = stack.wait_for(f'servewell_worker_up{{model="{MODEL}"}}')
    assert up["metric"]["worker"] == "0"
    assert up["metric"]["instance"].startswith("127.0.0.1:")
    assert "exported_instance" not in up["metric"]


def test_rules_load_and_evaluate_without_errors(stack: PrometheusApi):
    expected = {a["alert"] for a in alerts()}

    def evaluated() -> list[dict] | None:
        groups = stack.get("/api/v1/rules")["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return groups if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    groups = eventually(evaluated, 60, "Prometheus did not evaluate every rule", interval_s=0.5)
    rules = [rule for group in groups for rule in group["rules"]]
    assert {g["name"] for g in groups} == {"servewell-recording", "servewell-alerts"}
    assert {r["name"] for r in rules if r["type"] == "alerting"} == expected
    broken = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not broken, broken
    stack.wait_for(f'servewell:http_responses:rate5m{{model="{MODEL}"}} > 0')
    (errors,) = stack.wait_for(f'servewell:request_errors:ratio_rate5m{{model="{MODEL}"}}')
    assert float(errors["value"][1]) == 0  # 4xx are not errors
    stack.wait_for(f'servewell:queue_fill:ratio{{model="{MODEL}"}} >= 0')


def test_a_healthy_server_fires_no_alert(stack: PrometheusApi):
    stack.wait_for(f'servewell:http_responses:rate5m{{model="{MODEL}"}} > 0')
    firing = [a["labels"] for a in stack.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert firing == []


CORE_PANELS = {
    "Request rate by outcome", "HTTP responses by status class", "Request latency p50 / p95 / p99",
    "Latency by stage (p95)", "Queue depth per lane", "In-flight requests", "Batch size distribution",
    "Mean batch size vs effective max", "Model state", "Workers up", "Model loads", "Worker memory vs budget",
    "Worker private memory", "Worker CPU", "Worker threads",
}


def test_every_dashboard_query_parses_and_core_panels_have_data(stack: PrometheusApi):
    stack.wait_for(f'sum(rate(servewell_batch_size_count{{model="{MODEL}"}}[30s])) > 0')
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    assert CORE_PANELS <= {p["title"] for p in panels}
    empty = []
    for panel in panels:
        results = []
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", "30s").replace("$__range", "5m")
                    .replace("$instance", ".*").replace("$model", MODEL))
            results += stack.query(expr)  # a parse error fails here
        if panel["title"] in CORE_PANELS and not results:
            empty.append(panel["title"])
    assert not empty, f"core panels without data: {empty}"
