"""The model pool's admin API and visibility (issue 21): pin, unpin, preload and evict over
`/admin/models/{name}/...`, and each model's residency in /healthz, the repository index,
/metrics and the console.

One module server (lazy mode, the split as in production, an admin token set) serves tiny ONNX
models, `pinned` (pinned: true in model.yaml) and `a`, `b`, `c`, `d`, in a budget that holds
three of them: `pinned` plus two others (and `big`, which never fits). The tests run in order
and each sets up the residency it needs from what the one before left. Every admin call carries
the token; one test shows that a caller without it is refused and changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from browser import console_problems, headless_chromium
from model_dirs import onnx_mlp_model
from servers import ServerFactory, ServerProcess
from servewell.config.model_file import read_model_yaml
from servewell.engine.memory_budget import estimate_model_memory
from waiting import eventually

TOKEN = "pool-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEVICE_BUDGET = 1 << 30
POOL_FIELDS = {"residency", "loadable", "pinned", "last_used_at", "estimated_bytes", "cold_starts", "evictions"}


def infer(server: ServerProcess, model: str) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1.0, 2.0, 3.0, 4.0]}]}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)


def admin(server: ServerProcess, name: str, action: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/models/{name}/{action}", headers=AUTH if headers is None else headers,
                      timeout=60)


def models(server: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = server.health()["models"]
    return doc


def residency(server: ServerProcess) -> dict[str, str]:
    return {name: m["residency"] for name, m in models(server).items()}


def metric(server: ServerProcess, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` with these labels, None when there is none."""
    found = None
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                found = (found or 0.0) + sample.value
    return found


@pytest.fixture(scope="module")
def budget_bytes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp("pool-admin")
    onnx_mlp_model(root, "pinned", pinned=True)
    for name in ("a", "b", "c", "d"):
        onnx_mlp_model(root, name)
    onnx_mlp_model(root, "big", instances=4)  # more than the whole budget
    one = estimate_model_memory(read_model_yaml(root / "a"), root / "a").total_bytes
    return root, 3 * one + one // 2  # pinned plus two others, not three


@pytest.fixture(scope="module")
def pool(budget_bytes: tuple[Path, int], start_module_server: ServerFactory) -> ServerProcess:
    root, budget = budget_bytes
    server = start_module_server(["--model-repository", str(root), "--repository-mode", "lazy",
                                  "--memory-budget-bytes", str(budget), "--repository-poll-s", "0",
                                  "--device-memory-budget-bytes", str(DEVICE_BUDGET), "--admin-token", TOKEN])
    server.wait_live()  # not wait_ready: "big" is listed invalid (more than the whole budget), on purpose
    eventually(lambda: models(server)["pinned"]["residency"] == "resident", 180, "the pinned model did not load")
    return server


def test_pin_keeps_a_model_through_an_eviction_it_would_otherwise_suffer(pool: ServerProcess) -> None:
    for name in ("a", "b"):  # a, then b: a is the least recently used, the one a load would evict
        assert infer(pool, name).status_code == 200
    pinned = admin(pool, "a", "pin")
    assert pinned.status_code == 200, pinned.text
    doc = pinned.json()
    assert doc["name"] == "a" and doc["pinned"] is True and doc["residency"] == "resident"
    assert POOL_FIELDS | {"state", "reason", "version"} <= set(doc)
    before = metric(pool, "servewell_model_evictions_total", model="a") or 0.0
    try:
        assert infer(pool, "c").status_code == 200  # needs room: b goes, although a was used longer ago
        now = residency(pool)
        assert now["a"] == "resident" and now["b"] == "evicted" and now["c"] == "resident", now
        assert models(pool)["a"]["pinned"] is True
        assert (metric(pool, "servewell_model_evictions_total", model="a") or 0.0) == before
    finally:
        unpinned = admin(pool, "a", "unpin")
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False
    # The same room needed again: now a, the least recently used, is the one that goes.
    assert infer(pool, "b").status_code == 200
    now = residency(pool)
    assert now["a"] == "evicted" and now["b"] == "resident" and now["c"] == "resident", now
    assert metric(pool, "servewell_model_evictions_total", model="a", reason="memory") == before + 1


def test_preload_loads_a_model_that_is_not_resident(pool: ServerProcess) -> None:
    assert models(pool)["d"]["residency"] == "not_loaded" and models(pool)["d"]["cold_starts"] == 0
    loaded = admin(pool, "d", "preload")
    assert loaded.status_code == 200, loaded.text
    doc = loaded.json()
    assert doc["residency"] == "resident" and doc["state"] == "ready" and doc["cold_starts"] == 1, doc
    assert models(pool)["d"]["residency"] == "resident"
    again = admin(pool, "d", "preload")  # resident: nothing to do
    assert again.status_code == 200 and again.json()["cold_starts"] == 1
    assert infer(pool, "d").status_code == 200
    assert models(pool)["d"]["cold_starts"] == 1  # the request found it loaded


def test_preload_of_a_model_that_cannot_fit_is_refused_with_the_numbers(pool: ServerProcess) -> None:
    before = residency(pool)
    refused = admin(pool, "big", "preload")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "load_failed", refused.text
    message = refused.json()["error"]["message"]
    assert "MiB" in message and "more than the whole" in message and "MiB memory budget" in message, message
    assert residency(pool) == before  # nothing was evicted for it: no eviction could make room
    assert models(pool)["big"]["loadable"] is False and models(pool)["big"]["state"] == "invalid"


def test_evict_frees_the_model_and_its_next_request_loads_it_again(pool: ServerProcess) -> None:
    assert infer(pool, "c").status_code == 200
    before = models(pool)["c"]
    reserved = pool.health()["pool"]["reserved_bytes"]
    counted = metric(pool, "servewell_model_evictions_total", model="c", reason="operator") or 0.0
    evicted = admin(pool, "c", "evict")
    assert evicted.status_code == 200, evicted.text
    doc = evicted.json()
    assert doc["residency"] == "evicted" and doc["evictions"] == before["evictions"] + 1, doc
    assert residency(pool)["c"] == "evicted"
    assert reserved - pool.health()["pool"]["reserved_bytes"] == before["estimated_bytes"]  # its memory is free
    assert metric(pool, "servewell_model_evictions_total", model="c", reason="operator") == counted + 1
    lines = [json.loads(line) for line in pool.log().splitlines() if '"model_evicted"' in line]
    assert any(e.get("model") == "c" and e.get("reason") == "operator" for e in lines), lines[-3:]
    assert infer(pool, "c").status_code == 200  # loaded again by its next request
    after = models(pool)["c"]
    assert after["residency"] == "resident" and after["cold_starts"] == before["cold_starts"] + 1


def test_evict_refuses_a_pinned_a_not_resident_and_an_unknown_model(pool: ServerProcess) -> None:
    refused = admin(pool, "pinned", "evict")
    assert refused.status_code == 409 and refused.headers["x-error-code"] == "conflict"
    assert "pinned" in refused.json()["error"]["message"]
    assert residency(pool)["pinned"] == "resident"
    absent = next(name for name, where in residency(pool).items() if where != "resident")
    refused = admin(pool, absent, "evict")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "conflict", refused.text
    for action in ("pin", "unpin", "preload", "evict"):
        unknown = admin(pool, "no-such-model", action)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found", (action, unknown.text)


def test_a_hostile_model_name_is_refused_and_not_echoed_whole(pool: ServerProcess) -> None:
    long_name = "x" * 1500 + "TAIL"
    for action in ("pin", "evict"):
        r = admin(pool, long_name, action)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text[:300]
        assert "x" * 100 not in r.text and len(r.text) < 600  # cut short (errors.quote), not echoed whole
    odd = admin(pool, "%22%3Cscript%3E%00%FF", "preload")
    assert odd.status_code in (400, 404) and odd.headers["content-type"] == "application/json", odd.text


def test_admin_routes_refuse_a_caller_without_the_admin_token(pool: ServerProcess) -> None:
    assert infer(pool, "b").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for action in ("pin", "unpin", "preload", "evict"):
            refused = admin(pool, "b", action, headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", refused.text
    b = models(pool)["b"]
    assert b["residency"] == "resident" and b["pinned"] is False  # nothing of it happened


def test_metrics_show_each_models_place_in_the_pool(pool: ServerProcess, budget_bytes: tuple[Path, int]) -> None:
    assert infer(pool, "b").status_code == 200
    listed = models(pool)
    for name, m in listed.items():
        assert metric(pool, "servewell_model_resident", model=name) == (1.0 if m["residency"] == "resident" else 0.0)
        assert metric(pool, "servewell_model_pinned", model=name) == (1.0 if m["pinned"] else 0.0)
        assert metric(pool, "servewell_model_estimated_bytes", model=name) == m["estimated_bytes"]
    used = metric(pool, "servewell_model_last_used_timestamp_seconds", model="b")
    assert used is not None and abs(used - listed["b"]["last_used_at"]) < 1.0
    counts = {where: sum(1 for m in listed.values() if m["residency"] == where)
              for where in ("resident", "loading", "evicted", "not_loaded", "failed", "invalid")}
    for where, count in counts.items():
        assert metric(pool, "servewell_model_pool_models", residency=where) == count, where
    assert metric(pool, "servewell_memory_budget_bytes", kind="total") == budget_bytes[1]
    assert metric(pool, "servewell_memory_budget_bytes", kind="device_total") == DEVICE_BUDGET
    assert metric(pool, "servewell_memory_budget_bytes", kind="device_reserved") == 0  # CPU models


def test_healthz_and_the_repository_index_show_residency(pool: ServerProcess, budget_bytes: tuple[Path, int]) -> None:
    health = pool.health()
    summary = health["pool"]
    assert summary["mode"] == "lazy" and summary["budget_bytes"] == budget_bytes[1]
    assert summary["device_budget_bytes"] == DEVICE_BUDGET
    listed = health["models"]
    assert summary["resident"] == sum(1 for m in listed.values() if m["residency"] == "resident")
    assert summary["models"] == len(listed) and summary["pinned"] >= 1
    assert 0 < summary["reserved_bytes"] <= summary["budget_bytes"]
    index = {m["name"]: m for m in httpx.post(pool.url + "/v2/repository/index", timeout=10).json()}
    assert set(index) == set(listed)
    for name, entry in index.items():
        assert POOL_FIELDS <= set(entry), entry
        assert entry["residency"] == listed[name]["residency"] and entry["pinned"] == listed[name]["pinned"]
    assert any(e["residency"] != "resident" and e["loadable"] for e in index.values())  # lazy: listed, loadable


def test_the_console_shows_residency_and_the_pool_summary(pool: ServerProcess, tmp_path: Path) -> None:
    doc = httpx.get(pool.url + "/console/api/state", headers=AUTH, timeout=10).json()
    assert doc["server"]["pool"]["mode"] == "lazy"
    by_name = {m["name"]: m for m in doc["models"]}
    assert POOL_FIELDS <= set(by_name["pinned"]) and by_name["pinned"]["pinned"] is True
    assert by_name["pinned"]["residency"] == "resident"
    absent = next(name for name, m in by_name.items() if m["residency"] != "resident")

    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        driver.get(pool.url + "/")
        WebDriverWait(driver, 30, 0.25).until(lambda d: d.execute_script("return window.servewellConsole.polls") >= 1)
        line = driver.find_element(By.CSS_SELECTOR, '#models tr[data-model="pinned"] .pool-line')
        assert "resident" in line.text and "pinned" in line.text and "est." in line.text, line.text
        other = driver.find_element(By.CSS_SELECTOR, f'#models tr[data-model="{absent}"] .pool-line')
        assert other.get_attribute("data-residency") == by_name[absent]["residency"]
        # No worker of a model that is not loaded is listed as a dead one (its last ones are history).
        assert driver.find_elements(By.CSS_SELECTOR, f'#models tr[data-model="{absent}"] .instance') == []
        assert driver.find_elements(By.CSS_SELECTOR, '#models tr[data-model="pinned"] .instance .dot.alive')
        summary = driver.find_element(By.ID, "pool-summary").text
        assert "lazy repository" in summary and "resident" in summary and "reserved" in summary, summary
        assert console_problems(driver) == []
    finally:
        driver.quit()


def test_in_eager_mode_evict_unloads_and_preload_brings_the_model_back(
        start_server: ServerFactory, tmp_path: Path) -> None:
    """No admin token: a loopback client is the admin (as for every /admin route)."""
    onnx_mlp_model(tmp_path, "m")
    server = start_server(["--model-repository", str(tmp_path)])
    server.wait_ready()
    assert server.health()["pool"]["mode"] == "eager"
    evicted = admin(server, "m", "evict", headers={})
    assert evicted.status_code == 200 and evicted.json()["residency"] == "evicted", evicted.text
    assert evicted.json()["loadable"] is False  # eager: no request loads it back
    refused = infer(server, "m")
    assert refused.status_code == 503 and refused.json()["code"] == "model_not_ready", refused.text
    loaded = admin(server, "m", "preload", headers={})
    assert loaded.status_code == 200 and loaded.json()["residency"] == "resident", loaded.text
    assert infer(server, "m").status_code == 200
