"""The probe paths, ports, arguments and environment of the manifests, against the real server.

The Deployment's container (rendered from overlays/cpu) is started as the kubelet would start it,
with its own arguments and environment (only the repository path, address and port are moved to this
machine), serving a model that takes seconds to load. While it loads, every liveness probe must
pass and every readiness/startup probe must fail; once it is ready, all must pass; the scrape path
must serve the metrics the autoscalers query.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from processes import ChildProcess, free_port
from tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[3]
KUBE = ROOT / "deploy" / "kubernetes"
METRIC = re.compile(r"\bservewell_[a-z0-9_]+")


@dataclass(slots=True, frozen=True)
class LoadingServer:
    """The Deployment's container run here: its process, where it listens, and the manifest's port."""

    process: ChildProcess
    port: int
    container_port: int


def rendered(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: .ci/run installs it (Debian package `kubectl`)")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=60)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def deployment_container() -> dict[str, Any]:
    deployment = next(d for d in rendered(KUBE / "overlays" / "cpu") if d["kind"] == "Deployment")
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "servewell")


def serving_runtime_container() -> dict[str, Any]:
    runtime = yaml.safe_load((KUBE / "kserve" / "servingruntime.yaml").read_text())
    return runtime["spec"]["containers"][0]


def probes(c: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Each probe's (path, port number), named ports resolved through the container's ports."""
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    found: dict[str, tuple[str, int]] = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in c:
            port = c[kind]["httpGet"]["port"]
            found[kind] = (c[kind]["httpGet"]["path"], named.get(port, port))
    return found


def autoscaler_metrics() -> set[str]:
    """servewell metric names that the adapter rules, the KEDA triggers and the InferenceService query."""
    texts = [
        (KUBE / "prometheus-adapter" / "values.yaml").read_text(),
        (KUBE / "components" / "keda" / "scaledobject.yaml").read_text(),
        (KUBE / "kserve" / "inferenceservice.yaml").read_text(),
    ]
    names = set()
    for text in texts:
        for line in text.splitlines():
            if not line.lstrip().startswith("#"):
                names |= set(METRIC.findall(line))
    return names - {"servewell_queue_wait_seconds_mean"}  # the adapter's own name for the derived series


@pytest.fixture(scope="module")
def loading_server(tmp_path_factory: pytest.TempPathFactory):
    """servewell started with the Deployment's arguments and environment; its model loads slowly."""
    c = deployment_container()
    container_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    port = free_port()
    repository = tmp_path_factory.mktemp("probes-repo")
    write_tiny_model(repository, runtime="pytorch", load_delay_s=4.0)
    moved = {
        "--model-repository=/mnt/models": f"--model-repository={repository}",
        "--host=0.0.0.0": "--host=127.0.0.1",
        f"--port={container_port}": f"--port={port}",
    }
    assert set(moved) <= set(c["args"]), c["args"]  # the manifest's own values, moved to this machine
    # The container's gRPC port (8001 by default) is moved too: tests run servers side by side.
    args = [moved.get(a, a) for a in c["args"]] + ["--grpc-port", str(free_port())]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}  # the admin token: a Secret
    log = tmp_path_factory.mktemp("probes-log") / "server.log"
    process = ChildProcess([sys.executable, "-m", "servewell", "serve", *args], log, env)
    try:
        yield LoadingServer(process, port, container_port)
    finally:
        process.stop()


def test_liveness_passes_and_readiness_fails_while_the_model_loads_then_all_pass(loading_server):
    c = deployment_container()
    paths = probes(c)
    assert {port for _, port in paths.values()} == {loading_server.container_port}
    url = f"http://127.0.0.1:{loading_server.port}"
    loading_server.process.wait_http_ok(url + paths["livenessProbe"][0], 120)
    seen_loading = 0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        codes = {kind: httpx.get(url + path, timeout=5).status_code for kind, (path, _) in paths.items()}
        if codes["readinessProbe"] == 200:
            break
        assert codes == {"startupProbe": 503, "readinessProbe": 503, "livenessProbe": 200}, codes
        seen_loading += 1
        time.sleep(0.2)
    else:
        pytest.fail(f"never ready:\n{loading_server.process.log()[-3000:]}")
    assert seen_loading >= 5, "the model loaded too fast to see the probes while loading"
    assert all(httpx.get(url + path, timeout=5).status_code == 200 for path, _ in paths.values())
    # The KServe runtime probes the same paths on the port its --port argument names.
    runtime = serving_runtime_container()
    assert f"--port={runtime['ports'][0]['containerPort']}" in runtime["args"]
    for path, port in probes(runtime).values():
        assert port == runtime["ports"][0]["containerPort"]
        assert httpx.get(url + path, timeout=5).status_code == 200
    # The model serves through the manifest's configuration.
    answer = httpx.post(
        url + "/v2/models/tiny/infer",
        timeout=30,
        json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [3.0]}]},
    )
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [6.0]


def test_scrape_path_serves_the_metrics_the_autoscalers_query(loading_server):
    monitor = next(d for d in rendered(KUBE / "overlays" / "cpu") if d["kind"] == "ServiceMonitor")
    podmonitor = yaml.safe_load((KUBE / "kserve" / "podmonitor.yaml").read_text())
    paths = {e["path"] for e in monitor["spec"]["endpoints"]} | {
        e["path"] for e in podmonitor["spec"]["podMetricsEndpoints"]
    }
    wanted = autoscaler_metrics()
    assert {"servewell_queue_depth", "servewell_queue_wait_seconds_sum", "servewell_queue_wait_seconds_count"} <= wanted
    url = f"http://127.0.0.1:{loading_server.port}"
    loading_server.process.wait_http_ok(url + "/v2/health/ready", 180)
    # One request, so that the queue-wait histogram has a series.
    httpx.post(
        url + "/v2/models/tiny/infer",
        timeout=30,
        json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]},
    )
    for path in paths:
        response = httpx.get(url + path, timeout=10)
        assert response.status_code == 200
        exposed = {m for m in METRIC.findall(response.text)}
        assert wanted <= exposed, wanted - exposed
