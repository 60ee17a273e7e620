"""Every way into a model passes through the one admission chain (issue 46), through a real split
server: a request that loads its model cold follows the traffic split and the version it named
and is payload-logged; a pipeline's steps are judged by their model's canary; and a request that
can no longer finish in time is refused before it costs compute, over HTTP, gRPC and through a
pipeline alike.

The models are python models that append a line to a file per batch they compute, so "never
computed" is counted, not assumed."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import yaml
from tritonclient.utils import InferenceServerException

from error_bodies import error_code
from servers import ServerFactory, ServerProcess
from waiting import eventually

COUNTING = textwrap.dedent('''
    import time
    from pathlib import Path

    import numpy as np


    class Counting:
        """y = x * factor after `delay_s`, one line appended to `log` per batch; a version with `fail`
        raises on every batch (a model error)."""

        def setup(self, config):
            settings = config["settings"]
            self.factor, self.delay_s = settings.get("factor", 1.0), settings.get("delay_s", 0.0)
            self.fail, self.log = settings.get("fail", False), Path(settings["log"])

        def execute(self, inputs):
            with self.log.open("a") as log:
                log.write(f"{len(inputs['x'])}\\n")
            if self.fail:
                raise ValueError("this version is broken")
            time.sleep(self.delay_s)
            return {"y": (inputs["x"] * self.factor).astype(np.float32)}
''')
TENSORS = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
           "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}


def counting(directory: Path, log: Path, version: str = "1", **settings_and_fields: Any) -> None:
    settings = {key: settings_and_fields.pop(key) for key in ("factor", "delay_s", "fail")
                if key in settings_and_fields}
    directory.mkdir(parents=True)
    (directory / "counting.py").write_text(COUNTING)
    config: dict[str, Any] = {
        "version": version, "runtime": "python", "artifact": "counting.py", "max_batch_size": 4, "warmup": False,
        "python": {"entry": "counting:Counting", "settings": {"log": str(log), **settings}}, **TENSORS,
        **settings_and_fields,
    }
    (directory / "model.yaml").write_text(yaml.safe_dump(config))


def pipeline(directory: Path, step_model: str) -> None:
    directory.mkdir(parents=True)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "kind": "pipeline", "max_batch_size": 1, **TENSORS,
        "pipeline": {"steps": [{"name": "only", "model": step_model, "inputs": {"x": "x"}}],
                     "outputs": {"y": "only.y"}},
    }))


def computed(log: Path) -> int:
    """Batches the model computed so far (its lines)."""
    return len(log.read_text().splitlines()) if log.is_file() else 0


def infer(server: ServerProcess, model: str, value: float = 1.0, version: str | None = None,
          headers: dict[str, str] | None = None) -> httpx.Response:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    return httpx.post(server.url + path, json=body, headers=headers or {}, timeout=120)


# --- a cold load: the split, the version named, the payload log ----------------------------------


def test_a_cold_load_follows_the_split_and_the_version_named_and_is_payload_logged(
        tmp_path: Path, start_server: ServerFactory) -> None:
    repo, staging, conf = tmp_path / "repo", tmp_path / "staging", tmp_path / "conf"
    counting(repo / "plain", tmp_path / "plain.log")  # the server starts with something to serve
    counting(staging / "split", tmp_path / "split.log", traffic={"1": 50, "2": 50}, rollout={"sticky": "none"})
    counting(staging / "split" / "versions" / "2", tmp_path / "split2.log", version="2", factor=3.0)
    conf.mkdir()
    (conf / "server.yaml").write_text(yaml.safe_dump({"payload_log": {
        "enabled": True, "models": ["split"], "file": {"path": str(conf / "payload.jsonl")}}}))
    server = start_server(["--model-repository", str(repo), "--repository-mode", "lazy", "--repository-poll-s", "0.5",
                           "--config", str(conf / "server.yaml")])
    server.wait_ready()
    shutil.copytree(staging / "split", repo / "split")  # appears while serving: nothing loads it until asked
    eventually(lambda: "split" in server.health()["models"], 30, "the new model was listed")
    assert server.health()["models"]["split"]["residency"] != "resident"
    first = infer(server, "split", 2.0, version="2", headers={"X-Request-ID": "cold-and-named"})
    assert first.status_code == 200, first.text  # was 404: "has no version '2'" before the load
    assert first.headers["x-model-version"] == "2" and first.json()["outputs"][0]["data"] == [6.0]
    answered_by = [infer(server, "split").headers["x-model-version"] for _ in range(30)]
    assert set(answered_by) == {"1", "2"}, answered_by  # was 30 of 30 from version 1
    eventually(lambda: (conf / "payload.jsonl").is_file() and "cold-and-named" in (conf / "payload.jsonl").read_text(),
               20, "the cold-loaded request was payload-logged")
    records = [json.loads(line) for line in (conf / "payload.jsonl").read_text().splitlines()]
    assert {r["version"] for r in records} == {"1", "2"}


# --- a pipeline's steps are judged by their model's canary --------------------------------------


def test_a_pipeline_steps_failures_roll_back_their_models_canary(tmp_path: Path, start_server: ServerFactory) -> None:
    repo = tmp_path / "repo"
    counting(repo / "m", tmp_path / "m.log", traffic={"1": 50, "2": 50},
             rollout={"sticky": "none", "rollback": {"min_requests": 10, "window_s": 60}})
    counting(repo / "m" / "versions" / "2", tmp_path / "m2.log", version="2", fail=True)
    pipeline(repo / "chain", "m")
    server = start_server(["--model-repository", str(repo)])
    server.wait_ready()
    eventually(lambda: all(v["state"] == "ready" for v in httpx.get(
        f"{server.url}/admin/models/m/rollout", timeout=10).json()["versions"].values()), 120, "version 2 loaded")

    def rolled_back() -> bool:
        for _ in range(10):  # pipeline traffic only: nothing calls m directly
            infer(server, "chain")
        rollout = httpx.get(f"{server.url}/admin/models/m/rollout", timeout=10).json()
        return rollout["state"] == "rolled_back"

    eventually(rolled_back, 90, "the canary was judged on its pipeline steps and rolled back")
    answers = [infer(server, "chain") for _ in range(10)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]  # version 1 alone now


# --- a request that cannot finish is refused before compute, on every path ----------------------


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("deadline-repo")
    log = tmp_path_factory.mktemp("deadline-logs") / "slow.log"
    counting(root / "slow", log, delay_s=0.3, batching={"policy": "idle"})
    pipeline(root / "through", "slow")
    server = start_module_server(["--model-repository", str(root)])
    server.wait_ready()
    server.compute_log = log  # type: ignore[attr-defined]
    for _ in range(3):  # the scheduler learns what a batch takes
        assert infer(server, "slow").status_code == 200
    return server


def test_a_request_that_cannot_finish_in_time_is_refused_before_compute_on_every_path(
        slow_server: ServerProcess) -> None:
    log: Path = slow_server.compute_log  # type: ignore[attr-defined]
    before = computed(log)
    timeout = {"X-Request-Timeout-Ms": "100"}  # a batch takes 300 ms
    direct = infer(slow_server, "slow", headers=timeout)
    through = infer(slow_server, "through", headers=timeout)
    client = triton_grpc.InferenceServerClient(slow_server.grpc_url)
    tensor = triton_grpc.InferInput("x", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
    with pytest.raises(InferenceServerException) as grpc_refusal:
        client.infer("slow", [tensor], timeout=100_000)  # OIP's timeout parameter, in microseconds
    for answer in (direct, through):
        assert answer.status_code == 503 and error_code(answer) == "deadline_exceeded", answer.text
        assert "not started" in answer.json()["error"]
    assert "deadline" in str(grpc_refusal.value)
    # The refusals came before compute; a request with time enough is computed (the count can move).
    assert computed(log) == before
    assert infer(slow_server, "through").status_code == 200 and computed(log) == before + 1
