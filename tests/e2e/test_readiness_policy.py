"""The readiness policy: one failed model keeps the others in rotation by default (`any`), takes the
server out with `strict` (Triton's), and matters only when listed with `required-models`. Every
policy shows the failed model in per-model readiness, /healthz and metrics. And a model that
crash-loops until it is failed says how its workers died (the exit code)."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import httpx
import pytest
import torch
import yaml
from safetensors.torch import save_file

from faults import metric_value
from model_dirs import infer_body as body

SLEEPY = textwrap.dedent('''
    import time

    from torch import nn


    def build():
        time.sleep(8)  # a model that takes a while to load
        return nn.Linear(1, 1)
''')

CRASHES_WHEN_MARKED = textwrap.dedent('''
    import os

    from torch import nn


    def build(marker: str):
        if os.path.exists(marker):
            os._exit(3)  # a worker that dies while loading, every time
        return nn.Linear(1, 1)
''')


def onnx_model(root, name: str, broken: bool = False) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    if broken:
        (directory / "model.onnx").write_bytes(b"this is not an onnx graph")
    else:
        torch.onnx.export(torch.nn.Linear(1, 1), (torch.zeros(2, 1),), str(directory / "model.onnx"), dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    }))


def factory_model(root, name: str, source: str, **kwargs: object) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "factory.py").write_text(source)
    save_file({"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}, str(directory / "model.safetensors"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors",
        "pytorch": {"factory": "factory:build", "factory_kwargs": kwargs},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], "max_batch_size": 4,
    }))


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/healthz", timeout=10)


def settled(url: str, names: list[str], timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        models = health(url).json()["models"]
        if all(models[n]["state"] in ("ready", "failed") for n in names):
            return models
        time.sleep(0.2)
    raise AssertionError(f"models not settled: {models}")


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("readiness-repo")
    onnx_model(root, "good")
    onnx_model(root, "broken", broken=True)
    return root


@pytest.fixture(scope="module")
def servers(repository, start_module_server):
    """One server per policy, started together (they load the same repository)."""
    start_server = start_module_server
    started = {
        "any": start_server(["--model-repository", str(repository)]),
        "strict": start_server(["--model-repository", str(repository), "--readiness", "strict"]),
        "required good": start_server(["--model-repository", str(repository), "--readiness", "required-models",
                                       "--required-models", "good"]),
        "required broken": start_server(["--model-repository", str(repository), "--readiness", "required-models",
                                         "--required-models", "good,broken"]),
    }
    for server in started.values():
        server.wait_live()
        settled(server.url, ["good", "broken"])
    return started


@pytest.mark.parametrize("policy, ready", [("any", True), ("strict", False), ("required good", True),
                                           ("required broken", False)])
def test_a_failed_model_and_the_readiness_of_each_policy(servers, policy, ready):
    url = servers[policy].url
    assert (httpx.get(url + "/v2/health/ready").status_code == 200) is ready
    doc = health(url)
    assert (doc.status_code == 200) is ready
    report = doc.json()
    assert report["ready"] is ready and report["status"] == ("degraded" if ready else "not_ready")
    assert report["readiness"]["policy"] == ("required-models" if policy.startswith("required") else policy)
    if not ready:
        assert "broken" in report["readiness"]["reason"]
    # Under every policy the failed model is visible as such, and the healthy one serves.
    broken = report["models"]["broken"]
    assert broken["state"] == "failed" and broken["ready"] is False and "model.onnx" in broken["reason"]
    assert report["models"]["good"]["ready"] is True
    assert httpx.get(url + "/v2/models/broken/ready").status_code == 503
    assert httpx.get(url + "/v2/models/good/ready").status_code == 200
    assert httpx.post(url + "/v2/models/good/infer", json=body(1.0)).status_code == 200
    assert metric_value(url, "servewell_model_state", model="broken", state="failed") == 1.0
    assert metric_value(url, "servewell_ready") == (1.0 if ready else 0.0)


def test_any_waits_for_every_first_load_before_it_reports_ready(tmp_path, start_server):
    onnx_model(tmp_path, "good")
    factory_model(tmp_path, "sleepy", SLEEPY)
    server = start_server(["--model-repository", str(tmp_path)])
    server.wait_live()
    deadline = time.monotonic() + 120
    while health(server.url).json()["models"]["good"]["state"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.1)
    report = health(server.url).json()
    if report["models"]["sleepy"]["state"] == "loading":  # (a very slow machine may load both first)
        assert report["ready"] is False and "still loading" in report["readiness"]["reason"]
        assert httpx.get(server.url + "/v2/health/ready").status_code == 503
    settled(server.url, ["good", "sleepy"])
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200


def test_a_crash_looping_model_ends_failed_with_its_exit_code_while_the_others_serve(tmp_path, start_server):
    marker = tmp_path / "crash-from-now-on"
    repo = tmp_path / "repo"
    onnx_model(repo, "good")
    factory_model(repo, "crashy", CRASHES_WHEN_MARKED, marker=str(marker))
    server = start_server(["--model-repository", str(repo)])
    server.wait_ready()
    victim = health(server.url).json()["models"]["crashy"]["instances"][0]["pid"]
    marker.touch()
    os.kill(victim, signal.SIGKILL)
    models = settled_failed = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        doc = health(server.url)
        models = doc.json()["models"]
        if models["crashy"]["state"] == "failed":
            settled_failed = doc
            break
        assert doc.status_code == 200, doc.json()  # restarting or failed, crashy never takes "good" out
        time.sleep(0.5)
    assert settled_failed is not None, models
    reason = models["crashy"]["reason"]
    # It said "last: None" before: now the exit code of the last attempt (the restarts die while loading).
    assert "restarted 5 times without recovering" in reason and "exit code 3" in reason, reason
    assert settled_failed.status_code == 200 and settled_failed.json()["status"] == "degraded"
    assert httpx.post(server.url + "/v2/models/good/infer", json=body(1.0)).status_code == 200
    assert "killed by SIGKILL (exit code -9); restarting" in server.log()
