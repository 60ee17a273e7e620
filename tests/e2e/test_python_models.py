"""Python models served by the real server: answers over HTTP (JSON and tritonclient), platform python
in the metadata, an exception in execute failing only the request that caused it while the others of
its batch get their answers and the worker serves on, a killed worker restarted, and a lazy load on a
spare worker (forked with servewell, numpy and onnxruntime imported)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import yaml

from error_bodies import error_of
from servers import ServerFactory, ServerProcess
from waiting import eventually

STEPS = textwrap.dedent('''
    import time

    import numpy as np


    class Scaler:
        """y = x * factor; refuses the magic value, if the settings name one."""

        def setup(self, config):
            settings = config["settings"]
            self.factor = settings.get("factor", 1.0)
            self.magic = settings.get("magic")
            self.delay_s = settings.get("delay_ms", 0) / 1000.0

        def execute(self, inputs):
            x = inputs["x"]
            if self.magic is not None and (x == self.magic).any():
                raise ValueError(f"refusing the magic value {self.magic}")
            time.sleep(self.delay_s)
            return {"y": x.astype(np.float64) * self.factor}
''')


def python_model(root: Path, name: str, **fields: Any) -> None:
    """A python model `steps:Scaler` (every model's module is `steps`), x [2] -> y [2]."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "steps.py").write_text(STEPS)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "steps.py",
        "python": {"entry": "steps:Scaler", "settings": fields.pop("settings", {})},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}], "max_batch_size": 8, **fields,
    }))


def rows(values: list[list[float]]) -> dict[str, Any]:
    flat = [v for row in values for v in row]
    return {"inputs": [{"name": "x", "shape": [len(values), 2], "datatype": "FP32", "data": flat}]}


def model_health(server: ServerProcess, name: str) -> dict[str, Any]:
    model: dict[str, Any] = server.health()["models"][name]
    return model


def worker_pids(server: ServerProcess, name: str) -> list[int]:
    return [instance["pid"] for instance in model_health(server, name)["instances"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("python-models")
    python_model(root, "scale", settings={"factor": 3.0})
    # Concurrent requests wait for each other, so the magic value shares its batch with good rows.
    python_model(root, "check", settings={"magic": 13.0, "delay_ms": 20},
                 batching={"policy": "window", "max_wait_ms": 300})
    python_model(root, "victim", settings={"factor": 2.0})
    srv = start_module_server(["--model-repository", str(root), "--config-poll-s", "0"])
    srv.wait_ready()
    return srv


def test_a_python_model_answers_over_json_and_tritonclient(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v2/models/scale/infer", json=rows([[1, 2], [3, 4]]))
    assert r.status_code == 200, r.text
    (output,) = r.json()["outputs"]
    assert output["name"] == "y" and output["datatype"] == "FP32" and output["shape"] == [2, 2]
    assert output["data"] == [3.0, 6.0, 9.0, 12.0]  # float64 from execute, FP32 as declared

    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    batch = np.array([[0.5, -1.0]], dtype=np.float32)
    tensor = triton.InferInput("x", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch, binary_data=True)
    result = client.infer("scale", [tensor], outputs=[triton.InferRequestedOutput("y")])
    answer = result.as_numpy("y")
    assert answer.dtype == np.float32
    np.testing.assert_array_equal(answer, [[1.5, -3.0]])


def test_the_metadata_says_platform_python(server: ServerProcess) -> None:
    meta = httpx.get(f"{server.url}/v2/models/scale").json()
    assert meta["platform"] == "python"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    assert httpx.get(f"{server.url}/v2/models/scale/config").json()["backend"] == "python"
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.get_model_metadata("scale")["platform"] == "python"


def test_an_exception_in_execute_fails_only_its_request_and_the_worker_serves_on(server: ServerProcess) -> None:
    before = worker_pids(server, "check")
    values = [1.0, 2.0, 13.0, 4.0, 5.0, 6.0]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/v2/models/check/infer", json=rows([[v, v]]))
                                          for v in values))

    answers = asyncio.run(send_all())
    for value, answer in zip(values, answers, strict=True):
        if value == 13.0:
            assert answer.status_code == 500, answer.text
            error = error_of(answer)
            assert error["code"] == "model_error"
            assert "refusing the magic value 13.0 (at steps.py:" in error["message"], error
            assert "Traceback" not in answer.text and "File \"" not in answer.text
        else:
            assert answer.status_code == 200, (value, answer.text)
            assert answer.json()["outputs"][0]["data"] == [value, value]
    # The magic value did share a batch with good rows: the failed batch was run again request by request.
    assert "running each alone" in server.log()
    health = model_health(server, "check")
    assert health["state"] == "ready" and health["restarts"] == 0 and worker_pids(server, "check") == before
    assert httpx.post(f"{server.url}/v2/models/check/infer", json=rows([[7, 8]])).status_code == 200


def test_a_killed_worker_is_restarted_and_serves_again(server: ServerProcess) -> None:
    (victim,) = worker_pids(server, "victim")
    os.kill(victim, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        model = model_health(server, "victim")
        return model if model["state"] == "ready" and model["restarts"] >= 1 \
            and victim not in worker_pids(server, "victim") else None

    eventually(restarted, 60, lambda: f"the killed worker was not replaced:\n{server.log()[-3000:]}")
    r = httpx.post(f"{server.url}/v2/models/victim/infer", json=rows([[1, 2]]))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2.0, 4.0]


def events(log: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of `event`."""
    found = []
    for line in log.splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                found.append(doc)
    return found


def test_a_lazy_load_takes_a_spare_worker(tmp_path: Path, start_server: ServerFactory) -> None:
    python_model(tmp_path, "first", settings={"factor": 10.0})
    python_model(tmp_path, "second", settings={"factor": 100.0})  # a module named steps too
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy", "--config-poll-s", "0"])
    server.wait_ready()
    adopted: set[int] = set()
    for name, factor in (("first", 10.0), ("second", 100.0)):
        eventually(lambda: [d for d in events(server.log(), "spare_ready") if d["pid"] not in adopted], 120,
                   lambda: server.log()[-3000:])
        r = httpx.post(f"{server.url}/v2/models/{name}/infer", json=rows([[1, 2]]), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [factor, 2 * factor]
        (start,) = [doc for doc in events(server.log(), "worker_cold_start") if doc["model"] == name]
        assert start["spare"] is True, start
        adopted.add(start["pid"])
    assert len(adopted) == 2
