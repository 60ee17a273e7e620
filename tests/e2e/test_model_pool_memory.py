"""The lazy pool's memory budget holds what models really hold, and says what it cannot ever hold.

- issue 45 H16: the budget counted estimates only (all server processes peaked at 1,929 MB under a
  500 MiB budget). A python model's estimate is its interpreter's base (its files are tiny), but
  this one allocates 150 MiB in `setup`: once measured after warm-up, the budget counts that, so a
  second such model evicts the first, where by the estimates both would stay.
- issue 45 W3: a model bigger than the whole budget was refused at each request with "only 36 MiB
  left" (as if eviction could help), `Retry-After: 1` and `loadable: true`.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from pool_models import pool_body, pool_model
from servers import ServerFactory, ServerProcess
from servewell.config.model_file import read_model_yaml
from servewell.engine.memory_budget import estimate_model_memory
from waiting import eventually

MiB = 1 << 20
BALLAST_MIB = 150
#: Twice a python model's estimate (60 MiB) fits; a measured one (its 150 MiB and the interpreter's
#: 15-20 MiB, measured here) and another's estimate do not.
BUDGET_BYTES = 200 * MiB


def infer(server: ServerProcess, name: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{name}/infer", json=pool_body(), timeout=120)


def estimated(directory: Path) -> int:
    return estimate_model_memory(read_model_yaml(directory), directory).total_bytes


def test_a_model_measured_above_its_estimate_is_counted_by_its_measurement_and_evicted_for_the_next(
        start_server: ServerFactory, tmp_path: Path) -> None:
    one = estimated(pool_model(tmp_path, "heavy_a", ballast_mib=BALLAST_MIB))
    pool_model(tmp_path, "heavy_b", ballast_mib=BALLAST_MIB)
    assert 2 * one <= BUDGET_BYTES  # by their estimates, both would stay resident
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy",
                           "--memory-budget-bytes", str(BUDGET_BYTES)])
    server.wait_ready()
    assert infer(server, "heavy_a").status_code == 200
    assert infer(server, "heavy_b").status_code == 200
    health = server.health()
    models, pool = health["models"], health["pool"]
    assert models["heavy_a"]["residency"] == "evicted", models["heavy_a"]  # before: both stayed resident
    assert models["heavy_b"]["residency"] == "resident"
    a, b = models["heavy_a"], models["heavy_b"]
    assert a["estimated_bytes"] == b["estimated_bytes"] == one
    for measured in (a["measured_bytes"], b["measured_bytes"]):  # what a worker holds after warm-up
        assert BALLAST_MIB * MiB <= measured <= BUDGET_BYTES, (a, b)
    assert a["budget_bytes"] is None  # evicted: it holds nothing; its measurement is kept for its next load
    assert b["budget_bytes"] == b["measured_bytes"]  # counted by the larger of the two
    assert pool["reserved_bytes"] == b["measured_bytes"] <= BUDGET_BYTES, pool
    assert pool["estimated_bytes"] == one and pool["measured_bytes"] == b["measured_bytes"], pool
    evictions = [json.loads(line) for line in server.log().splitlines() if '"model_evicted"' in line]
    assert [(e["model"], e["reason"]) for e in evictions] == [("heavy_a", "memory")]
    assert evictions[0]["freed_bytes"] == a["measured_bytes"]  # the eviction counted what it measured


def test_a_model_bigger_than_the_whole_budget_never_loads_and_is_refused_without_retry_after(
        start_server: ServerFactory, tmp_path: Path) -> None:
    one = estimated(pool_model(tmp_path, "small"))
    pool_model(tmp_path, "huge", instances=4)
    budget = 3 * one
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy",
                           "--memory-budget-bytes", str(budget)])
    server.wait_live()
    huge = eventually(lambda: server.health().get("models", {}).get("huge"), 60, "the engine did not list huge")
    assert huge["state"] == "invalid" and huge["loadable"] is False and huge["residency"] == "invalid", huge
    assert huge["estimated_bytes"] == 4 * one
    assert f"whole {budget / MiB:.0f} MiB memory budget" in huge["reason"], huge["reason"]
    refused = infer(server, "huge")
    assert refused.status_code == 503 and refused.json()["code"] == "model_not_ready", refused.text
    assert "retry-after" not in refused.headers  # retrying cannot help: only a bigger budget or a smaller model
    assert "more than the whole" in refused.json()["error"] and "left" not in refused.json()["error"]
    assert infer(server, "small").status_code == 200
    ready = httpx.get(f"{server.url}/v2/models/huge/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["loadable"] is False
