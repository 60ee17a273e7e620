"""A rollback as the on-call sees it (issue 24): the server's own alert with the evidence, in /healthz
and the console's feed, the console's models table showing each rollout's state, and the alert ending
once an admin returns to the file's weights.

- `canary`: version 1 and versions/2 failing every batch, 50/50, rules over a 5 s window;
- `split`: version 1 and versions/2 (the same scorer), 70/30: a canary that stays in.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from browser import console_problems, headless_chromium
from servers import ServerFactory, ServerProcess
from waiting import eventually

# test_rollouts.py's scorer, cut to what this needs: a version that fails `fail_rate` of its batches.
SCORER = textwrap.dedent('''
    import random

    import numpy as np


    class Scorer:
        def setup(self, config):
            self.fail_rate = config["settings"].get("fail_rate", 0.0)

        def execute(self, inputs):
            if random.random() < self.fail_rate:
                raise RuntimeError("a bad canary fails on purpose")
            e = np.exp(inputs["x"] - inputs["x"].max(axis=-1, keepdims=True))
            return {"scores": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)}
''')
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [0.1, 0.9, 0.3]}]}


def scorer(directory: Path, version: str, settings: dict[str, Any], **fields: Any) -> None:
    directory.mkdir(parents=True)
    (directory / "scorer.py").write_text(SCORER)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "version": version, "runtime": "python", "artifact": "scorer.py",
        "python": {"entry": "scorer:Scorer", "settings": settings},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [3]}], "max_batch_size": 8, "warmup": False,
        **fields,
    }))


def model_with_versions(root: Path, name: str, candidate: dict[str, Any], **fields: Any) -> None:
    scorer(root / name, "1", {}, **fields)
    scorer(root / name / "versions" / "2", "2", candidate)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("rollout-console")
    model_with_versions(root / "repo", "canary", {"fail_rate": 1.0}, traffic={"1": 50, "2": 50}, rollout={
        "sticky": "none", "rollback": {"window_s": 5, "min_requests": 10, "max_error_rate_increase": 0.1}})
    model_with_versions(root / "repo", "split", {}, traffic={"1": 70, "2": 30})
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({"alerting": {"evaluation_interval_s": 1.0}}))
    srv = start_module_server(["--model-repository", str(root / "repo"), "--config", str(config)])
    srv.wait_ready()

    def versions_ready() -> bool:  # the other versions load after the stable ones, which serve meanwhile
        models = console_models(srv.url)
        return all(models[name]["rollout"]["versions"].get("2") == "ready" for name in ("canary", "split"))

    eventually(versions_ready, 60, lambda: f"versions not ready: {console_models(srv.url)}")
    return srv


@pytest.fixture
def browser(tmp_path: Path):
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        yield driver
    finally:
        driver.quit()


def console_models(url: str) -> dict[str, dict[str, Any]]:
    doc = httpx.get(f"{url}/console/api/state", timeout=10).json()
    return {m["name"]: m for m in doc["models"]}


def rollback_alerts(url: str) -> list[dict[str, Any]]:
    return [a for a in httpx.get(f"{url}/healthz", timeout=10).json()["alerts"] if a["name"] == "rollout_rolled_back"]


def roll_back_the_canary(url: str) -> dict[str, Any]:
    """Load on `canary` until its rules take version 2 back; its rollout as the console feed shows it."""
    async def main() -> dict[str, Any]:
        stop = asyncio.Event()

        async def one(client: httpx.AsyncClient) -> None:
            while not stop.is_set():
                await client.post(f"{url}/v2/models/canary/infer", json=BODY)

        async with httpx.AsyncClient(timeout=10) as client:
            load = asyncio.gather(*(one(client) for _ in range(4)))
            try:
                for _ in range(600):
                    rollout = (await asyncio.to_thread(console_models, url))["canary"]["rollout"]
                    if rollout["state"] == "rolled_back":
                        return dict(rollout)
                    await asyncio.sleep(0.1)
                raise AssertionError(f"never rolled back: {rollout}")
            finally:
                stop.set()
                await load

    return asyncio.run(main())


ROLLOUT_LINES = """
const lines = {};
for (const row of document.querySelectorAll('#models tr.model-row')) {
  const line = row.querySelector('.rollout-line');
  lines[row.dataset.model] = line ? [line.dataset.rolloutState, line.innerText] : null;
}
return lines;
"""


def test_a_rollback_alerts_with_its_evidence_and_the_console_shows_each_rollout(server: ServerProcess,
                                                                                browser) -> None:
    models = console_models(server.url)
    assert models["canary"]["rollout"]["state"] == "canary" and models["split"]["rollout"]["state"] == "canary"
    assert rollback_alerts(server.url) == []  # nothing rolled back yet: would notice one

    rollout = roll_back_the_canary(server.url)
    assert rollout["weights"] == {"1": 50.0, "2": 0.0} and "version '2'" in rollout["reason"]

    # The server's own alert names the version and carries the rule's numbers, and says what to do.
    def fired() -> dict[str, Any] | None:
        found = rollback_alerts(server.url)
        return found[0] if found else None

    alert = eventually(fired, 30, "the rollout_rolled_back alert")
    assert (alert["model"], alert["severity"], alert["prometheus"]) == ("canary", "critical",
                                                                         "ServewellRolloutRolledBack")
    assert rollout["reason"] in alert["summary"] and "%" in alert["summary"]
    assert "GET /admin/models/canary/rollout" in alert["action"]

    # The console's table: a badge per rollout, the weights in force, and why the canary went.
    browser.get(server.url + "/")

    def shown() -> dict[str, Any] | None:
        lines = browser.execute_script(ROLLOUT_LINES)  # one read: the table is rebuilt on every poll
        return lines if lines.get("canary") and lines.get("split") else None

    lines = eventually(shown, 30, "both rollouts in the console's models table")
    state, text = lines["canary"]
    assert state == "rolled_back" and "rolled back" in text and "v1 100% · v2 0%" in text
    assert rollout["reason"] in text
    state, text = lines["split"]
    assert state == "canary" and "v1 70% · v2 30%" in text and "failed" not in text
    assert console_problems(browser) == []

    # An admin returns to the file's weights: the verdict is cleared, and the alert ends with it.
    r = httpx.patch(f"{server.url}/admin/models/canary/rollout", json={"traffic": None}, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "canary"
    eventually(lambda: rollback_alerts(server.url) == [], 30, "the alert to end")
    assert console_models(server.url)["canary"]["rollout"]["reason"] == "weights set by an admin"
