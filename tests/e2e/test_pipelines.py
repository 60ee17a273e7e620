"""Pipelines (issue 23) through a real server, with httpx and tritonclient's HTTP and gRPC clients.

The repository holds the example pipelines (`python -m servewell.examples.build pipelines`):
`digits_page` (crop on a page -> ONNX classifier -> format, all python but the classifier) and
`digits_ensemble` (the CNN and a logistic regression at once, averaged), plus small python models
made here to fail on purpose:

- `check` raises on the value 13; `echo` sleeps 300 ms per batch (one row at a time); `double`
  and `triple` scale their input.
- `fragile`: check -> echo (a step that raises); `slowchain`: echo -> echo (a step killed, a step
  past the deadline); `router`: double when `route` is 1, triple when it is 2 (a switch);
  `swap`: double, then triple after its model.yaml changes (hot reload); `mismatched` (added by a
  test): wired to a model input that does not exist (refused at load with the mismatch).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import yaml
from PIL import Image

from error_bodies import error_code, error_of
from monitoring import scraped_total
from otlp_collector import Collector
from servers import ServerFactory, ServerProcess
from servewell.examples.digits import load_split, render_digit
from waiting import eventually

STEP = textwrap.dedent('''
    import time

    import numpy as np


    class Step:
        def setup(self, config):
            settings = config["settings"]
            self.factor = settings.get("factor", 1.0)
            self.delay_s = settings.get("delay_ms", 0) / 1000.0
            self.fail_on = settings.get("fail_on")

        def execute(self, inputs):
            x = inputs["x"]
            if self.fail_on is not None and np.any(x == self.fail_on):
                raise ValueError(f"refusing the value {self.fail_on}")
            if self.delay_s:
                time.sleep(self.delay_s)
            return {"y": x * self.factor}
''')
SCALAR = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
          "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}


def python_step(root: Path, name: str, **settings: Any) -> None:
    directory = root / name
    directory.mkdir()
    (directory / "step.py").write_text(STEP)
    batch = {"max_batch_size": 1} if settings.get("delay_ms") else {"max_batch_size": 8}
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "step.py", "python": {"entry": "step:Step", "settings": settings},
        **SCALAR, **batch, "warmup": False,
    }))


def pipeline(root: Path, name: str, steps: list[dict[str, Any]], outputs: dict[str, Any],
             inputs: list[dict[str, Any]] | None = None, max_batch_size: int = 1) -> None:
    directory = root / name
    directory.mkdir()
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "kind": "pipeline", "max_batch_size": max_batch_size, "inputs": inputs or SCALAR["inputs"],
        "outputs": SCALAR["outputs"], "pipeline": {"steps": steps, "outputs": outputs},
    }))


def build_examples(root: Path, cache: Path) -> None:
    """The example pipelines, reusing a digits model trained already (by another test module of this
    session, or `make serve`'s: the build is deterministic, and its stamp is checked before reuse)."""
    for built in (cache / "models" / "digits", Path.home() / ".cache" / "servewell" / "models" / "digits"):
        if (built / "model.yaml").is_file():
            shutil.copytree(built, root / "digits")
            break
    subprocess.run([sys.executable, "-m", "servewell.examples.build", "pipelines", "--out", str(root)], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, servewell_cache: Path,
           start_module_server: ServerFactory) -> Any:
    root = tmp_path_factory.mktemp("pipelines")
    build_examples(root, servewell_cache)
    python_step(root, "check", fail_on=13.0)
    python_step(root, "echo", delay_ms=300)
    python_step(root, "double", factor=2.0)
    python_step(root, "triple", factor=3.0)
    pipeline(root, "fragile", [{"name": "check", "model": "check", "inputs": {"x": "x"}},
                               {"name": "echo", "model": "echo", "inputs": {"x": "check.y"}}], {"y": "echo.y"})
    pipeline(root, "slowchain", [{"name": "first", "model": "echo", "inputs": {"x": "x"}},
                                 {"name": "second", "model": "echo", "inputs": {"x": "first.y"}}], {"y": "second.y"})
    pipeline(root, "router", [
        {"name": "double", "model": "double", "inputs": {"x": "x"}, "when": {"tensor": "route", "equals": 1}},
        {"name": "triple", "model": "triple", "inputs": {"x": "x"}, "when": {"tensor": "route", "equals": 2}},
    ], {"y": ["double.y", "triple.y"]}, inputs=[*SCALAR["inputs"], {"name": "route", "datatype": "INT64",
                                                                    "shape": [1]}])
    pipeline(root, "swap", [{"name": "one", "model": "double", "inputs": {"x": "x"}}], {"y": "one.y"})
    collector = Collector()
    server = start_module_server(
        ["--model-repository", str(root), "--slow-request-ms", "0.001", "--slow-request-lines-per-model", "10000"],
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_TRACES_SAMPLER_ARG": "1.0"})
    server.wait_ready()
    eventually(lambda: all(models(server)[m] == "ready" for m in ("digits_page", "digits_ensemble", "fragile")),
               120, "the pipelines did not become ready")
    yield server, collector, root
    collector.close()


def models(server: ServerProcess) -> dict[str, str]:
    health = httpx.get(server.url + "/healthz", timeout=10).json()
    return {name: doc["state"] for name, doc in health["models"].items()}


def infer(server: ServerProcess, model: str, value: float, timeout_s: float = 30, **parameters: Any) -> httpx.Response:
    body: dict[str, Any] = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    if parameters:
        body["parameters"] = parameters
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=timeout_s)


def pages(count: int, size: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """`count` test digits, each drawn somewhere on a larger blank page: ([n, 1, size, size], labels)."""
    _, x_test, _, y_test = load_split()
    rng = np.random.default_rng(7)
    out = np.full((count, 1, size, size), 255.0, dtype=np.float32)
    for i in range(count):
        digit = np.asarray(render_digit(x_test[i], 32), dtype=np.float32)
        y, x = rng.integers(0, size - 32, size=2)
        out[i, 0, y:y + 32, x:x + 32] = digit
    return out, y_test[:count]


def test_the_page_pipeline_reads_digits_anywhere_on_a_page_over_http(served: Any) -> None:
    server, _, _ = served
    batch, labels = pages(24)
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    right = 0
    for page, label in zip(batch, labels, strict=True):
        page_input = triton_http.InferInput("page", [1, *page.shape], "FP32")
        page_input.set_data_from_numpy(page[None], binary_data=True)
        result = client.infer("digits_page", [page_input])
        scores = result.as_numpy("scores")[0]
        assert abs(float(scores.sum()) - 1.0) < 1e-4
        assert int(result.as_numpy("label")[0, 0]) == int(scores.argmax())
        assert float(result.as_numpy("confidence")[0, 0]) == pytest.approx(float(scores.max()))
        box = result.as_numpy("box")[0]
        assert 0 <= box[0] < box[2] <= 96 and 0 <= box[1] < box[3] <= 96
        right += int(result.as_numpy("label")[0, 0]) == int(label)
    assert right >= 21, f"{right}/24 digits read right"
    metadata = client.get_model_metadata("digits_page")
    assert metadata["platform"] == "ensemble"
    assert [o["name"] for o in metadata["outputs"]] == ["scores", "label", "confidence", "box"]


def test_the_page_pipeline_takes_an_image_through_predict(served: Any) -> None:
    server, _, _ = served
    page, label = pages(1)
    buffer = io.BytesIO()
    Image.fromarray(page[0, 0].astype(np.uint8), "L").save(buffer, "PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    reply = httpx.post(server.url + "/predict", json={"image_base64": image, "model": "digits_page"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["result"]["label"] == str(label[0])


def test_each_step_is_a_stage_of_server_timing_and_the_slow_record(served: Any) -> None:
    server, _, _ = served
    batch, _ = pages(1)
    body = {"inputs": [{"name": "page", "shape": list(batch.shape), "datatype": "FP32",
                        "data": batch.ravel().tolist()}]}
    reply = httpx.post(server.url + "/v2/models/digits_page/infer", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    timing = {part.split(";")[0].strip(): part for part in reply.headers["server-timing"].split(",")}
    for step in ("crop", "classify", "format"):
        assert f"step.{step}" in timing and "desc=success" in timing[f"step.{step}"]
    request_id = reply.headers["x-request-id"]

    def slow_record() -> dict[str, Any] | None:
        state = httpx.get(server.url + "/console/api/state", params={"recent": 200}, timeout=10).json()
        return next((r for r in state["recent"] or [] if r["request_id"] == request_id), None)

    record = eventually(slow_record, 10, "the pipeline request has no slow-request record")
    assert {"step.crop", "step.classify", "step.format"} <= set(record["stages_ms"])


def test_the_ensemble_fans_out_over_grpc_and_averages_both_models(served: Any) -> None:
    server, _, _ = served
    _, x_test, _, y_test = load_split()
    from servewell.examples.digits import DIGITS_PREPROCESS
    from servewell.imaging import transform_image

    items = np.stack([transform_image(render_digit(x), DIGITS_PREPROCESS) for x in x_test[:16]])
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        def run(model: str, output: str) -> np.ndarray:
            given = triton_grpc.InferInput("input", list(items.shape), "FP32")
            given.set_data_from_numpy(items)
            answer = client.infer(model, [given]).as_numpy(output)
            assert answer is not None
            return answer

        ensemble = run("digits_ensemble", "scores")
        logits = run("digits", "logits")
        linear = run("digits_linear", "scores")
    cnn = np.exp(logits - logits.max(axis=1, keepdims=True))
    cnn /= cnn.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(ensemble, (cnn + linear) / 2, atol=1e-5)
    assert (ensemble.argmax(axis=1) == y_test[:16]).mean() >= 0.9


def test_a_step_that_raises_fails_that_request_only(served: Any) -> None:
    server, _, _ = served

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = lambda v: {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [v]}]}  # noqa: E731
            return await asyncio.gather(*(client.post(f"{server.url}/v2/models/fragile/infer", json=body(v))
                                          for v in (1.0, 13.0, 2.0, 3.0)))

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200, 500, 200, 200], [a.text for a in answers]
    assert error_code(answers[1]) == "model_error"
    message = error_of(answers[1])["message"]
    assert "pipeline 'fragile' step 'check' (model 'check')" in message
    assert [a.json()["outputs"][0]["data"] for a in answers if a.status_code == 200] == [[1.0], [2.0], [3.0]]
    assert scraped_total(server.url, "servewell_pipeline_steps_total", pipeline="fragile", step="check",
                         outcome="model_error") >= 1


def rows_computed(server: ServerProcess, model: str) -> int:
    health = httpx.get(server.url + "/healthz", timeout=10).json()
    return int(sum(i["rows_computed"] for i in health["models"][model]["instances"]))


def test_a_step_past_the_deadline_is_not_started(served: Any) -> None:
    server, _, _ = served
    assert infer(server, "slowchain", 5.0).status_code == 200  # the echo model's batch time is now measured
    before = rows_computed(server, "echo")
    late = infer(server, "slowchain", 6.0, timeout=450_000)  # 450 ms: the first step fits, the second cannot
    assert late.status_code == 503, late.text
    assert error_code(late) == "deadline_exceeded"
    assert "step 'second'" in error_of(late)["message"] and "not started" in error_of(late)["message"]
    assert rows_computed(server, "echo") == before + 1
    assert infer(server, "slowchain", 7.0).json()["outputs"][0]["data"] == [7.0]


def test_a_step_whose_worker_is_killed_fails_that_request_and_the_model_comes_back(served: Any) -> None:
    server, _, _ = served
    health = httpx.get(server.url + "/healthz", timeout=10).json()
    pid = health["models"]["echo"]["instances"][0]["pid"]

    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [8.0]}]}
            victim = asyncio.ensure_future(client.post(f"{server.url}/v2/models/slowchain/infer", json=body))
            await asyncio.sleep(0.15)
            os.kill(pid, signal.SIGKILL)
            others = [await client.post(f"{server.url}/v2/models/router/infer", json=router_body(float(i), 1))
                      for i in range(5)]
            return await victim, others

    victim, others = asyncio.run(run())
    assert victim.status_code == 503, victim.text
    assert error_code(victim) == "worker_lost"
    assert "pipeline 'slowchain' step 'first' (model 'echo')" in error_of(victim)["message"]
    assert [o.status_code for o in others] == [200] * 5
    eventually(lambda: infer(server, "slowchain", 9.0).status_code == 200, 60, "echo did not come back")


def router_body(x: float, route: int) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [x]},
                       {"name": "route", "shape": [1, 1], "datatype": "INT64", "data": [route]}]}


def test_a_switch_runs_the_branch_its_condition_picks(served: Any) -> None:
    server, _, _ = served
    url = f"{server.url}/v2/models/router/infer"
    assert httpx.post(url, json=router_body(5.0, 1), timeout=30).json()["outputs"][0]["data"] == [10.0]
    two = httpx.post(url, json=router_body(5.0, 2), timeout=30)
    assert two.json()["outputs"][0]["data"] == [15.0]
    assert "step.double;dur=0.000;desc=skipped" in two.headers["server-timing"]
    neither = httpx.post(url, json=router_body(5.0, 3), timeout=30)
    assert neither.status_code == 422 and error_code(neither) == "invalid_input"
    assert "no branch answered output 'y'" in error_of(neither)["message"]


def test_a_pipeline_that_does_not_fit_its_steps_is_refused_with_the_mismatch(served: Any) -> None:
    server, _, root = served
    pipeline(root, "mismatched", [{"name": "one", "model": "double", "inputs": {"x": "x", "z": "x"}}], {"y": "one.y"})
    load = httpx.post(server.url + "/v2/repository/models/mismatched/load", timeout=60)
    assert load.status_code == 422 and error_code(load) == "load_failed"
    assert "step 'one' (model 'double') has no input 'z'; its inputs are ['x']" in error_of(load)["message"]
    assert models(server)["mismatched"] == "failed"
    reply = infer(server, "mismatched", 1.0)
    assert reply.status_code == 503 and error_code(reply) == "model_not_ready"
    assert "has no input 'z'" in error_of(reply)["message"]
    assert models(server)["digits_page"] == "ready"  # the rest of the repository is untouched


def test_a_pipeline_output_wired_to_a_step_output_that_does_not_exist_is_refused_at_load(served: Any) -> None:
    """Issue 45 W6: it loaded ready, and every request got a 422 "skipped by their conditions"."""
    server, _, root = served
    pipeline(root, "miswired", [{"name": "one", "model": "double", "inputs": {"x": "x"}}], {"y": "one.nope"})
    load = httpx.post(server.url + "/v2/repository/models/miswired/load", timeout=60)
    assert load.status_code == 422 and error_code(load) == "load_failed", load.text
    assert "output 'y': step 'one' (model 'double') has no output 'nope'; its outputs are ['y']" \
        in error_of(load)["message"]
    assert models(server)["miswired"] == "failed"


def test_a_pipeline_reloads_live_when_its_model_yaml_changes(served: Any) -> None:
    server, _, root = served
    assert infer(server, "swap", 4.0).json()["outputs"][0]["data"] == [8.0]
    path = root / "swap" / "model.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["pipeline"]["steps"][0]["model"] = "triple"
    path.write_text(yaml.safe_dump(doc))
    eventually(lambda: infer(server, "swap", 4.0).json()["outputs"][0]["data"] == [12.0], 30,
               "the changed pipeline was not reloaded")


def test_each_step_has_a_span_under_the_request_span(served: Any) -> None:
    server, collector, _ = served
    traceparent = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [4.0]}]}
    reply = httpx.post(f"{server.url}/v2/models/fragile/infer", json=body, headers={"traceparent": traceparent},
                       timeout=30)
    assert reply.status_code == 200
    trace_id = bytes.fromhex(traceparent[3:35])

    def step_spans() -> list[Any] | None:
        spans = [s for s in collector.spans if s.trace_id == trace_id and s.name.startswith("step ")]
        return spans if len(spans) == 2 else None

    steps = eventually(step_spans, 20, "the two step spans were not exported")
    assert sorted(s.name for s in steps) == ["step check", "step echo"]

    def roots() -> list[str] | None:  # each step descends from the request's own span, which continues the
        # caller's trace; the ancestors come from other processes and batches, so wait for the whole chain
        by_id = {s.span_id: s for s in collector.spans if s.trace_id == trace_id}
        found = []
        for span in steps:
            parent = span
            while parent.parent_span_id in by_id:
                parent = by_id[parent.parent_span_id]
            found.append(parent.parent_span_id.hex())
        return found if all(root == traceparent[36:52] for root in found) else None

    eventually(roots, 20, "a step span does not descend from the caller's span")
    step_ids = {s.span_id for s in steps}

    def linked() -> bool | None:  # each step model's batch span links to the step span it ran for
        links = {link.span_id for b in collector.spans if b.name == "batch" for link in b.links}
        return step_ids <= links or None

    eventually(linked, 20, "no batch span links to the step spans")


def test_in_lazy_mode_a_pipeline_loads_its_step_models_on_its_first_request(
        tmp_path: Path, start_server: ServerFactory) -> None:
    python_step(tmp_path, "double", factor=2.0)
    python_step(tmp_path, "triple", factor=3.0)
    pipeline(tmp_path, "six", [{"name": "a", "model": "double", "inputs": {"x": "x"}},
                               {"name": "b", "model": "triple", "inputs": {"x": "a.y"}}], {"y": "b.y"})
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy"])
    server.wait_ready()
    health = httpx.get(server.url + "/healthz", timeout=10).json()["models"]
    assert health["six"]["state"] == "ready"  # a pipeline holds no memory: always resident
    assert health["double"]["residency"] != "resident" and health["triple"]["residency"] != "resident"
    reply = infer(server, "six", 1.5, timeout_s=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [9.0]
    health = httpx.get(server.url + "/healthz", timeout=10).json()["models"]
    assert health["double"]["residency"] == "resident" and health["triple"]["residency"] == "resident"
    evicted = httpx.post(server.url + "/admin/models/six/evict", timeout=10)
    assert evicted.status_code == 409 and "is a pipeline: it holds no memory" in error_of(evicted)["message"]


def test_the_request_lane_goes_through_every_step(served: Any) -> None:
    server, _, _ = served
    before = scraped_total(server.url, "servewell_requests_total", model="double", lane="high", outcome="success")
    reply = httpx.post(f"{server.url}/v2/models/router/infer", json=router_body(2.0, 1),
                       headers={"X-Urgency": "high"}, timeout=30)
    assert reply.json()["outputs"][0]["data"] == [4.0]
    eventually(lambda: scraped_total(server.url, "servewell_requests_total", model="double", lane="high",
                                     outcome="success") >= before + 1, 10, "the step did not run in the high lane")
