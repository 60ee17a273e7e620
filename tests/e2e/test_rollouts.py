"""Safe rollouts (issue 24) through a real server: traffic splits between versions, sticky routing,
shadow traffic and the automatic rollback of a bad canary under load.

Every model here is a small python model (`Scorer`): scores = softmax(x * factor), with settings
that make a version bad on purpose: `fail_rate` (that share of batches raise) and `flip` (its
top-1 disagrees with the stable version's).

- `split`: version 1 (stable) and versions/2 (the same scorer), 50/50, sticky by route key;
- `canary`: version 1 and versions/2 failing 40 % of its batches, at weight 20; rules over a 5 s window;
- `shadowed`: version 1 serves, versions/2 (flipped) shadows 100 % with an agreement rule;
- `linked`: version 1 and versions/2, a symlink to a directory outside the repository, 50/50.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.http as triton_http
import yaml

from error_bodies import error_code
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from waiting import eventually

SCORER = textwrap.dedent('''
    import random

    import numpy as np


    class Scorer:
        def setup(self, config):
            settings = config["settings"]
            self.factor = settings.get("factor", 1.0)
            self.fail_rate = settings.get("fail_rate", 0.0)
            self.flip = settings.get("flip", False)

        def execute(self, inputs):
            if self.fail_rate and random.random() < self.fail_rate:
                raise RuntimeError("a bad canary fails on purpose")
            z = inputs["x"] * self.factor
            if self.flip:
                z = -z
            e = np.exp(z - z.max(axis=-1, keepdims=True))
            return {"scores": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)}
''')
TENSORS = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
           "outputs": [{"name": "scores", "datatype": "FP32", "shape": [3]}]}


def scorer(directory: Path, version: str, settings: dict[str, Any] | None = None, **fields: Any) -> None:
    directory.mkdir(parents=True)
    (directory / "scorer.py").write_text(SCORER)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "version": version, "runtime": "python", "artifact": "scorer.py",
        "python": {"entry": "scorer:Scorer", "settings": settings or {}}, **TENSORS, "max_batch_size": 8,
        "warmup": False, **fields,
    }))


def model_with_versions(root: Path, name: str, candidate: dict[str, Any], **fields: Any) -> None:
    scorer(root / name, "1", **fields)
    scorer(root / name / "versions" / "2", "2", candidate)


def body(values: list[float] | None = None) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": values or [0.1, 0.9, 0.3]}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("rollouts")
    model_with_versions(root, "split", {}, traffic={"1": 50, "2": 50}, rollout={"sticky": "route_key"})
    model_with_versions(root, "canary", {"fail_rate": 0.4}, traffic={"1": 80, "2": 20}, rollout={
        "sticky": "none", "rollback": {"window_s": 5, "min_requests": 10, "max_error_rate_increase": 0.1}})
    model_with_versions(root, "shadowed", {"flip": True}, rollout={
        "shadow": {"version": "2", "percent": 100},
        "rollback": {"window_s": 5, "min_requests": 5, "min_shadow_agreement": 0.5}})
    linked_version(root, tmp_path_factory.mktemp("elsewhere"))
    srv = start_module_server(["--model-repository", str(root), "--config-poll-s", "0.5"])
    srv.wait_ready()
    for name in ("split", "canary", "shadowed", "linked"):
        versions_ready(srv, name)
    return srv


def linked_version(root: Path, elsewhere: Path) -> Path:
    """Model `linked`: version 1, and versions/2 a symlink to a directory under `elsewhere`; where
    that directory is."""
    scorer(root / "linked", "1", traffic={"1": 50, "2": 50}, rollout={"sticky": "none"})
    scorer(elsewhere / "v2", "2")
    (root / "linked" / "versions").mkdir()
    (root / "linked" / "versions" / "2").symlink_to(elsewhere / "v2")
    return (elsewhere / "v2").resolve()


def versions_ready(server: ServerProcess, name: str) -> None:
    """Wait for a model's other versions: they load after the stable one, which serves everything
    until they are ready."""
    def ready() -> bool:
        versions = rollout(server, name)["versions"]
        return bool(versions) and all(v["state"] == "ready" for v in versions.values())

    eventually(ready, 60, lambda: f"versions of {name} not ready: {rollout(server, name)}")


def rollout(server: ServerProcess, name: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/admin/models/{name}/rollout", timeout=10)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def test_a_split_answers_from_both_versions_and_says_which(server: ServerProcess) -> None:
    seen = set()
    for _ in range(40):
        r = httpx.post(f"{server.url}/v2/models/split/infer", json=body(), timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["x-model-version"] == r.json()["model_version"]
        seen.add(r.json()["model_version"])
    assert seen == {"1", "2"}
    meta = httpx.get(f"{server.url}/v2/models/split", timeout=10).json()
    assert meta["versions"] == ["1", "2"]


def test_a_route_key_sticks_to_one_version(server: ServerProcess) -> None:
    for user in ("alice", "bob", "carol", "dave", "erin"):
        versions = {httpx.post(f"{server.url}/v2/models/split/infer", json=body(), headers={"X-Route-Key": user},
                               timeout=10).json()["model_version"] for _ in range(8)}
        assert len(versions) == 1, (user, versions)


def test_a_version_in_the_path_wins_over_the_split(server: ServerProcess) -> None:
    for version in ("1", "2"):
        for _ in range(5):
            r = httpx.post(f"{server.url}/v2/models/split/versions/{version}/infer", json=body(), timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["model_version"] == version
    r = httpx.post(f"{server.url}/v2/models/split/versions/3/infer", json=body(), timeout=10)
    assert r.status_code == 404 and error_code(r) == "not_found"
    # tritonclient names the version too
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = triton_http.InferInput("x", [1, 3], "FP32")
    import numpy as np
    tensor.set_data_from_numpy(np.array([[0.1, 0.2, 0.3]], dtype=np.float32))
    assert client.infer("split", [tensor], model_version="2").get_response()["model_version"] == "2"


def test_an_admin_moves_the_weights_live_and_null_returns_to_the_file(server: ServerProcess) -> None:
    url = f"{server.url}/admin/models/split/rollout"
    r = httpx.patch(url, json={"traffic": {"1": 0, "2": 100}}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["weights"] == {"1": 0.0, "2": 100.0} and r.json()["set_by_admin"] is True
    assert {httpx.post(f"{server.url}/v2/models/split/infer", json=body(), timeout=10).json()["model_version"]
            for _ in range(10)} == {"2"}
    for bad, code in (({"traffic": {"9": 100}}, 404), ({"traffic": {"1": -1}}, 422), ({}, 422),
                      ({"traffic": {"1": "50"}}, 422), ({"shadow_percent": 5}, 404)):
        r = httpx.patch(url, json=bad, timeout=10)
        assert r.status_code == code, (bad, r.text)
    r = httpx.patch(url, json={"traffic": None}, timeout=10)
    assert r.status_code == 200 and r.json()["weights"] == {"1": 50.0, "2": 50.0}
    assert httpx.patch(f"{server.url}/admin/models/nope/rollout", json={"traffic": None}, timeout=10).status_code == 404


def test_a_bad_canary_is_rolled_back_under_load(server: ServerProcess) -> None:
    async def load(stop: asyncio.Event) -> dict[str, int]:
        counts: dict[str, int] = {}
        async with httpx.AsyncClient(timeout=10) as client:
            async def one() -> None:
                while not stop.is_set():
                    r = await client.post(f"{server.url}/v2/models/canary/infer", json=body())
                    key = r.json()["model_version"] if r.status_code == 200 else f"{r.status_code}"
                    counts[key] = counts.get(key, 0) + 1
            await asyncio.gather(*(one() for _ in range(4)))
        return counts

    async def until_rolled_back() -> tuple[dict[str, Any], dict[str, int]]:
        stop = asyncio.Event()
        task = asyncio.ensure_future(load(stop))
        try:
            for _ in range(600):
                doc = await asyncio.to_thread(rollout, server, "canary")
                if doc["state"] == "rolled_back":
                    return doc, {}
                await asyncio.sleep(0.1)
            raise AssertionError(f"never rolled back: {doc}")
        finally:
            stop.set()
            await task

    doc, _ = asyncio.run(until_rolled_back())
    assert doc["weights"]["2"] == 0.0 and doc["evidence"]["version"] == "2"
    assert doc["evidence"]["rule"] == "error_rate" and "version '2'" in doc["reason"]
    # From now on every request is the stable version's, and none fails.
    answers = [httpx.post(f"{server.url}/v2/models/canary/infer", json=body(), timeout=10) for _ in range(30)]
    assert {(r.status_code, r.json()["model_version"]) for r in answers} == {(200, "1")}
    assert scraped_total(server.url, "servewell_rollout_events_total", model="canary", version="2",
                         action="rollback", rule="error_rate") == 1
    assert scraped_total(server.url, "servewell_rollout_rolled_back", model="canary", version="2") == 1
    assert scraped_total(server.url, "servewell_rollout_requests_total", model="canary", version="2",
                         outcome="error") >= 1
    assert "rolled back version 2" in server.log()
    health = server.health()
    assert health["models"]["canary"]["rollout"]["state"] == "rolled_back"


def test_a_shadow_is_compared_never_returned_and_rolled_back_on_disagreement(server: ServerProcess) -> None:
    for _ in range(30):
        r = httpx.post(f"{server.url}/v2/models/shadowed/infer", json=body(), timeout=10)
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        scores = r.json()["outputs"][0]["data"]
        assert scores.index(max(scores)) == 1  # the primary's answer, not the flipped shadow's

    def judged() -> dict[str, Any] | None:
        doc = rollout(server, "shadowed")
        return doc if doc["state"] == "rolled_back" else None

    shadow = rollout(server, "shadowed")["versions"]["2"]
    assert shadow["cpu_policy"] == "idle"  # a version that only shadows runs on CPU time nobody else wants
    (worker,) = shadow["instances"]
    assert os.sched_getscheduler(worker["pid"]) == os.SCHED_IDLE
    (primary,) = server.health()["models"]["shadowed"]["instances"]
    assert os.sched_getscheduler(primary["pid"]) == os.SCHED_OTHER
    doc = eventually(judged, 30, lambda: f"no verdict: {rollout(server, 'shadowed')}")
    assert doc["evidence"]["rule"] == "shadow_agreement" and doc["shadow"]["percent"] == 0.0
    assert doc["shadow"]["compared"] >= 5 and doc["shadow"]["top1_agreement"] == 0.0
    assert scraped_total(server.url, "servewell_shadow_requests_total", model="shadowed", version="2",
                         outcome="compared") >= 5
    assert scraped_total(server.url, "servewell_shadow_top1_matches_total", model="shadowed", version="2") == 0
    assert scraped_total(server.url, "servewell_shadow_rows_total", model="shadowed", version="2") >= 5


def test_traffic_in_model_yaml_changes_live(tmp_path: Path, start_server: ServerFactory) -> None:
    model_with_versions(tmp_path, "live", {}, traffic={"1": 100, "2": 0})
    scorer(tmp_path / "live" / "versions" / "3", "3", {}, inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
           outputs=TENSORS["outputs"])
    srv = start_server(["--model-repository", str(tmp_path), "--config-poll-s", "0.3"])
    srv.wait_ready()
    eventually(lambda: "2" in rollout(srv, "live")["versions"], 60, "version 2 of live did not load")
    assert {httpx.post(f"{srv.url}/v2/models/live/infer", json=body(), timeout=10).json()["model_version"]
            for _ in range(10)} == {"1"}
    pids = [i["pid"] for i in srv.health()["models"]["live"]["instances"]]
    path = tmp_path / "live" / "model.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["traffic"] = {"1": 0, "2": 100, "3": 0}
    path.write_text(yaml.safe_dump(doc))

    def moved() -> bool:
        return httpx.post(f"{srv.url}/v2/models/live/infer", json=body(), timeout=10).json()["model_version"] == "2"

    eventually(moved, 30, "the traffic change did not apply")
    assert [i["pid"] for i in srv.health()["models"]["live"]["instances"]] == pids  # applied live, same workers
    state = rollout(srv, "live")
    assert "inputs" in state["versions"]["3"]["reason"] and state["versions"]["3"]["state"] == "failed"


def test_grpc_gets_the_split_the_route_key_and_the_version_that_answered(server: ServerProcess) -> None:
    import numpy as np
    import tritonclient.grpc as triton_grpc

    batch = np.array([[0.1, 0.9, 0.3]], dtype=np.float32)
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        def infer(headers: dict[str, str] | None = None, version: str = "") -> str:
            tensor = triton_grpc.InferInput("x", list(batch.shape), "FP32")
            tensor.set_data_from_numpy(batch)
            result = client.infer("split", [tensor], model_version=version, headers=headers)
            return str(result.get_response().model_version)

        assert {infer() for _ in range(30)} == {"1", "2"}
        for user in ("alice", "bob", "carol"):
            assert len({infer({"x-route-key": user}) for _ in range(6)}) == 1
        assert {infer(version="2") for _ in range(5)} == {"2"}


def test_a_version_directory_outside_the_repository_serves_with_a_warning(server: ServerProcess) -> None:
    """Issue 45 H9: it was served without the warning a model directory gets."""
    version = rollout(server, "linked")["versions"]["2"]
    assert version["state"] == "ready" and version["outside_repository"] is not None
    assert version["outside_repository"].endswith("/v2")
    assert "model linked: version 2: its directory" in server.log() and "outside the repository" in server.log()
    assert rollout(server, "split")["versions"]["2"]["outside_repository"] is None


def test_a_version_directory_outside_the_repository_is_refused_by_the_setting(
        tmp_path: Path, start_server: ServerFactory) -> None:
    real = linked_version(tmp_path / "repo", tmp_path / "elsewhere")
    srv = start_server(["--model-repository", str(tmp_path / "repo"), "--models-outside-repository", "refuse"])
    srv.wait_ready()

    def refused() -> dict[str, Any] | None:
        version = rollout(srv, "linked")["versions"].get("2")
        return version if version is not None and version["state"] == "failed" else None

    version = eventually(refused, 60, lambda: f"version 2 was not refused: {rollout(srv, 'linked')}")
    assert "outside the model repository" in version["reason"] and str(real) in version["reason"], version
    assert version["outside_repository"] == str(real)
    answered = {httpx.post(f"{srv.url}/v2/models/linked/infer", json=body(), timeout=10).json()["model_version"]
                for _ in range(10)}
    assert answered == {"1"}
