"""A model or a version whose directory is deleted from the repository stops taking traffic, its
requests in flight finished, and says so (issue 45 H13: in lazy mode a removed model still answered
200 and showed READY 20 s later; a deleted `versions/2` kept its 50 % share even after the stable
model.yaml was touched and SIGHUP sent). The workers run from the server's own snapshot of the
files, so nothing stopped them before.
"""

from __future__ import annotations

import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pool_models import pool_body, pool_model
from servers import ServerFactory, ServerProcess
from waiting import eventually


def infer(server: ServerProcess, name: str, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{name}/infer", json=pool_body(), timeout=timeout_s)


def removed_events(server: ServerProcess, event: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log().splitlines() if f'"{event}"' in line]


def test_a_model_whose_directory_is_removed_finishes_its_requests_then_answers_404(
        start_server: ServerFactory, tmp_path: Path) -> None:
    """Lazy mode, caught by the repository poll alone (no configuration poll)."""
    pool_model(tmp_path, "stays")
    pool_model(tmp_path, "goes", execute_ms=4000)
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy",
                           "--repository-poll-s", "0.5", "--config-poll-s", "0"])
    server.wait_ready()
    assert infer(server, "goes").status_code == 200  # loaded (4 s)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(infer, server, "goes")  # runs 4 s; the removal waits for a second poll
        shutil.rmtree(tmp_path / "goes")
        # Asked by its metadata: an inference request sent before the removal would wait its turn.
        eventually(lambda: httpx.get(f"{server.url}/v2/models/goes", timeout=10).status_code == 404, 20,
                   lambda: f"the removed model is still listed: {server.health()['models'].get('goes')}")
        refused = infer(server, "goes")
        assert not in_flight.done()  # it was taken out while this request ran...
        assert refused.status_code == 404 and "goes" in refused.json()["error"], refused.text
        assert in_flight.result().status_code == 200  # ...and the request was answered
    health = server.health()
    assert "goes" not in health["models"] and health["models"]["stays"]["state"] != "failed"
    assert [r["model"] for r in health["pool"]["removed"]] == ["goes"], health["pool"]
    assert "removed from the repository" in health["pool"]["removed"][0]["reason"]
    assert [e["model"] for e in removed_events(server, "model_removed")] == ["goes"]
    assert infer(server, "stays").status_code == 200


def test_sighup_takes_out_a_removed_model_at_once_and_no_model_yaml_is_reported_rejected(
        start_server: ServerFactory, tmp_path: Path) -> None:
    """Eager mode with no poll at all: SIGHUP is the only check."""
    pool_model(tmp_path, "stays")
    pool_model(tmp_path, "goes")
    server = start_server(["--model-repository", str(tmp_path), "--config-poll-s", "0"])
    server.wait_ready()
    shutil.rmtree(tmp_path / "goes")
    assert infer(server, "goes").status_code == 200  # nothing looked yet: its snapshot still serves
    server.proc.send_signal(signal.SIGHUP)
    eventually(lambda: infer(server, "goes").status_code == 404, 20, "SIGHUP did not take the removed model out")
    health = server.health()
    assert "goes" not in health["models"] and [r["model"] for r in health["pool"]["removed"]] == ["goes"]
    assert health["config"]["status"] == "ok", health["config"]  # its missing model.yaml is not a rejected file
    assert infer(server, "stays").status_code == 200


def versions_answering(server: ServerProcess, requests: int = 30) -> set[str]:
    return {infer(server, "split").json()["model_version"] for _ in range(requests)}


def test_a_removed_version_leaves_the_split_and_its_weight_goes_to_the_versions_left(
        start_server: ServerFactory, tmp_path: Path) -> None:
    pool_model(tmp_path, "split", traffic={"1": 50, "2": 50}, rollout={"sticky": "none"})
    pool_model(tmp_path / "split" / "versions", "2", version="2")
    server = start_server(["--model-repository", str(tmp_path), "--config-poll-s", "0"])
    server.wait_ready()
    eventually(lambda: versions_answering(server) == {"1", "2"}, 60, "the split does not answer from both versions")
    shutil.rmtree(tmp_path / "split" / "versions" / "2")
    (tmp_path / "split" / "model.yaml").touch()  # the steps: the stable model.yaml touched, SIGHUP
    server.proc.send_signal(signal.SIGHUP)
    eventually(lambda: versions_answering(server) == {"1"}, 20, "the removed version still takes traffic")
    split = server.health()["models"]["split"]
    assert split["state"] == "ready" and split["versions"] == ["1"], split
    rollout = httpx.get(f"{server.url}/admin/models/split/rollout", timeout=10).json()
    assert rollout["versions"]["2"]["state"] == "failed", rollout["versions"]
    assert "removed from the repository" in rollout["versions"]["2"]["reason"], rollout["versions"]
    assert [(e["model"], e["version"]) for e in removed_events(server, "version_removed")] == [("split", "2")]
