"""The on-call views (issue 47) from the outside: one shared server with three planted faults and
live traffic from two tenants, read only through the server's own views (the console's JSON and
page in a real Chromium, /healthz, /metrics, GET /admin/audit, the log, ps):

- `shared`: a slow model whose only lane tenant `alpha` floods (bravo sends a trickle);
- `cached`: a response cache whose TTL (0.5 s) is shorter than the interval its callers repeat an
  input at (about 1.25 s);
- `leaky`: a worker that keeps 60 MB per request and passes its host_memory_limit_bytes, so it is
  replaced again and again (one instance: every replacement is a gap its requests wait).

Each view must name the cause (the diagnosis, in the reading order), count refusals and
replacements by their tenant and cause, and record every change with who made it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from browser import console_problems, headless_chromium
from model_dirs import factory_model, infer_body, onnx_linear_model, slow_model
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from waiting import eventually

ALPHA, BRAVO, OPS = "alpha-key-0123456789abcdef", "bravo-key-0123456789abcdef", "ops-key-0123456789abcdef"
ADMIN = "oncall-admin-token-0123456789"
KEYS = f"alpha:{ALPHA} tenant=alpha\nbravo:{BRAVO} tenant=bravo\nops:{OPS} role=operator\n"
OPERATOR = {"Authorization": f"Bearer {ADMIN}"}

LEAKY = textwrap.dedent('''
    import torch
    from torch import nn

    class Leaky(nn.Module):
        """Keeps 60 MB per real (non-zero) batch: a leak that reaches its limit in a few requests."""

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.kept = []

        def forward(self, x):
            if bool((x != 0).any()):
                self.kept.append(torch.ones(15_000_000))
            return x * self.scale

    def build():
        return Leaky()
''')


def state(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = httpx.get(url + "/console/api/state?recent=50", headers=headers or OPERATOR, timeout=30)
    assert response.status_code == 200, response.text
    doc: dict[str, Any] = response.json()
    return doc


def model_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (model,) = [m for m in doc["models"] if m["name"] == name]
    return model


class Traffic:
    """The drill's clients, in threads until `stop`: alpha floods `shared` (12 at once, backing off
    50 ms after a refusal), bravo sends a trickle to it, cycles 5 inputs through `cached` every
    0.25 s, and calls `leaky` once a second."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stopped = threading.Event()
        self.codes: dict[str, dict[int, int]] = {}
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._flood, self._bravo, self._leak)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self.stopped.set()
        for thread in self._threads:
            thread.join(60)

    def _count(self, what: str, code: int) -> None:
        per = self.codes.setdefault(what, {})
        per[code] = per.get(code, 0) + 1

    def _flood(self) -> None:
        async def client(http: httpx.AsyncClient, n: int) -> None:
            while not self.stopped.is_set():
                try:
                    answer = await http.post("/v2/models/shared/infer", json=infer_body(float(n)))
                    self._count("alpha", answer.status_code)
                    if answer.status_code != 200:
                        await asyncio.sleep(0.05)
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)

        async def main() -> None:
            async with httpx.AsyncClient(base_url=self.url, headers={"X-API-Key": ALPHA}, timeout=30) as http:
                await asyncio.gather(*(client(http, n) for n in range(12)))

        asyncio.run(main())

    def _bravo(self) -> None:
        with httpx.Client(base_url=self.url, headers={"X-API-Key": BRAVO}, timeout=30) as http:
            i = 0
            while not self.stopped.wait(0.25):
                try:
                    cached = http.post("/v2/models/cached/infer", json=infer_body(float(i % 5)))
                    self._count("cached", cached.status_code)
                    if i % 2 == 0:
                        self._count("bravo", http.post("/v2/models/shared/infer", json=infer_body(7.0)).status_code)
                except httpx.HTTPError:
                    pass
                i += 1

    def _leak(self) -> None:
        with httpx.Client(base_url=self.url, headers={"X-API-Key": BRAVO}, timeout=60) as http:
            while not self.stopped.wait(1.0):
                try:
                    self._count("leaky", http.post("/v2/models/leaky/infer", json=infer_body(1.0)).status_code)
                except httpx.HTTPError:
                    pass


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory,
          start_module_server: ServerFactory) -> Iterator[tuple[ServerProcess, Traffic, Path]]:
    root = tmp_path_factory.mktemp("oncall")
    repo = root / "repo"
    slow_model(repo, "shared", 30.0, max_batch_size=1, batching={"max_queue_size": 8})
    onnx_linear_model(repo, "cached")
    cached_yaml = repo / "cached" / "model.yaml"
    config = yaml.safe_load(cached_yaml.read_text())
    config["cache"] = {"max_bytes": 1 << 20, "ttl_s": 0.5}
    cached_yaml.write_text(yaml.safe_dump(config))
    factory_model(repo, "leaky", LEAKY, max_batch_size=1, host_memory_limit_bytes=700 << 20)
    keys = root / "keys.txt"
    keys.write_text(KEYS)
    server = start_module_server(["--model-repository", str(repo), "--api-keys-file", str(keys), "--admin-token",
                                  ADMIN, "--config-poll-s", "0.5", "--slow-request-ms", "5000"])
    server.wait_ready()
    traffic = Traffic(server.url)
    traffic.start()
    try:
        yield server, traffic, root
    finally:
        traffic.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        yield driver
    finally:
        driver.quit()


def diagnosed(url: str, model: str, cause: str, timeout_s: float = 120) -> dict[str, Any]:
    """The console's document once `model`'s diagnosis names `cause`."""
    def found() -> dict[str, Any] | None:
        doc = state(url)
        diagnosis = model_of(doc, model)["diagnosis"]
        return doc if diagnosis is not None and diagnosis["cause"] == cause else None

    return eventually(found, timeout_s, lambda: f"{model} was never read as {cause}: "
                      f"{model_of(state(url), model)['diagnosis']}", interval_s=1.0)


def test_a_tenant_flood_is_named_with_its_tenant_in_every_view(drill) -> None:
    server, _, _ = drill
    doc = diagnosed(server.url, "shared", "tenant_holds_lane")
    diagnosis = model_of(doc, "shared")["diagnosis"]
    assert "'alpha'" in diagnosis["reading"] and "PATCH /admin/tenants/alpha" in diagnosis["advice"]
    assert "instances" not in diagnosis["advice"].replace("adding instances", "")  # never "add capacity"
    assert any("holds" in line and "alpha" in line for line in diagnosis["evidence"])
    # Refusals by tenant, model, lane and reason; alpha's tenant row never says ok while refused.
    rows = [r for r in doc["refusals_by"] if r["tenant"] == "alpha" and r["model"] == "shared"]
    assert rows and rows[0]["reason"] == "overloaded" and rows[0]["lane"] == "normal" and rows[0]["total"] > 0
    alpha = next(t for t in doc["tenants"] if t["tenant"] == "alpha")
    assert alpha["status"] in ("refused", "failing") and alpha["last_30s"]["refused"] > 0 and alpha["refused"] > 0
    tenants = httpx.get(server.url + "/admin/tenants", headers=OPERATOR, timeout=30).json()["tenants"]
    assert next(t for t in tenants if t["tenant"] == "alpha")["refused"] > 0
    assert scraped_total(server.url, "servewell_refusals_total", OPERATOR, tenant="alpha", model="shared",
                         reason="overloaded") > 0
    assert scraped_total(server.url, "servewell_diagnosis", OPERATOR, model="shared", cause="tenant_holds_lane") == 1
    # Who holds the lane's places, and the refusal log line names the tenant.
    eventually(lambda: "alpha" in state(server.url)["queue_places"].get("shared", {}).get("normal", {}), 60,
               "alpha was never seen holding shared's places")
    assert re.search(r"refused \d+ request\(s\) with overloaded .*model shared, tenant alpha", server.log())
    # A tenant's key sees its own tenant's refusals and places only.
    bravo = state(server.url, {"X-API-Key": BRAVO})
    assert {r["tenant"] for r in bravo["refusals_by"]} <= {"bravo"} and bravo["audit"] is None
    assert all(set(lanes) <= {"bravo"} for model in bravo["queue_places"].values() for lanes in model.values())
    assert [t["tenant"] for t in bravo["tenants"]] == ["bravo"]


def test_a_cache_ttl_shorter_than_the_reuse_interval_is_named_and_shown(drill) -> None:
    server, _, _ = drill
    doc = diagnosed(server.url, "cached", "cache_ttl_short")
    diagnosis = model_of(doc, "cached")["diagnosis"]
    assert "TTL (0.5 s)" in diagnosis["reading"] and '"ttl_s"' in diagnosis["advice"]
    cache = server.health()["models"]["cached"]["cache"]
    assert cache["ttl_s"] == 0.5 and cache["reused_beyond_ttl"] > 0 and cache["expired"] > 0
    assert cache["window"]["reused_beyond_ttl"] > cache["window"]["reused_within_ttl"]
    assert sum(b["count"] for b in cache["window"]["reuse_histogram"]) > 0
    assert scraped_total(server.url, "servewell_response_cache_reuses_total", OPERATOR, model="cached",
                         vs_ttl="beyond") > 0
    # A computed answer of a cached model says so (hits: tests/e2e/test_response_cache.py; a second request
    # here may come after the 0.5 s TTL on a busy machine).
    first = httpx.post(server.url + "/v2/models/cached/infer", json=infer_body(42.5), headers={"X-API-Key": BRAVO})
    assert "cache;desc=miss" in first.headers["server-timing"], first.headers["server-timing"]


def test_a_leaking_worker_is_replaced_as_an_event_with_its_cause_and_gap(drill) -> None:
    server, _, _ = drill
    doc = diagnosed(server.url, "leaky", "worker_replaced")
    diagnosis = model_of(doc, "leaky")["diagnosis"]
    assert "worker replaced (memory)" in diagnosis["reading"] and "leak" in diagnosis["advice"]
    assert any("requests waited" in line for line in diagnosis["evidence"]), diagnosis
    health = server.health()["models"]["leaky"]
    memory = health["restarts_by_reason"]["memory"]
    assert memory >= 1 and health["restarts"] >= memory and health["recycles"] == memory
    assert scraped_total(server.url, "servewell_worker_restarts_total", OPERATOR, model="leaky",
                         reason="memory") >= memory
    event = eventually(lambda: next((e for e in server.health()["models"]["leaky"]["replacements"]
                                      if e["gap_s"] is not None), None), 60, "no replacement ended")
    assert event["reason"] == "memory" and event["clients_waited"] and event["gap_s"] > 0
    assert "exceeds host_memory_limit_bytes" in event["detail"]
    assert "worker_replaced" in server.log() and "after a gap of" in server.log()

    def sawtooth() -> list[int] | None:
        series = [s for s in state(server.url)["memory"]["series"] if s["name"] == "worker leaky v1 #0"]
        pids = sorted({p for p in series[0]["pid"] if p}) if series else []
        return pids if len(pids) >= 2 else None

    eventually(sawtooth, 120, "the leaky worker's memory series never showed its replacement", interval_s=1.0)
    processes = {p["name"]: p for p in server.health()["memory"]["processes"]}
    assert {"engine", "ingress 0", "worker leaky v1 #0", "worker cached v1 #0"} <= set(processes)
    assert processes["worker leaky v1 #0"]["limit_bytes"] == 700 << 20
    assert server.health()["memory"]["definition"].startswith("resident set size")


def test_every_change_is_in_the_audit_trail_with_who_old_and_new(drill) -> None:
    server, _, root = drill
    url = server.url
    answer = httpx.patch(url + "/admin/models/shared/batching", json={"max_wait_ms": 3}, headers={"X-API-Key": OPS})
    assert answer.status_code == 200, answer.text
    assert httpx.patch(url + "/admin/tenants/alpha", json={"max_queued": 6}, headers=OPERATOR).status_code == 200
    keys = root / "keys.txt"
    new_key = "carol-key-0123456789abcdef-secret"
    keys.write_text(KEYS + f"carol:{new_key} tenant=carol\n")
    yaml_path = root / "repo" / "cached" / "model.yaml"
    config = yaml.safe_load(yaml_path.read_text())
    config.setdefault("batching", {})["max_wait_ms"] = 4
    yaml_path.write_text(yaml.safe_dump(config))

    def changes() -> list[dict[str, Any]] | None:
        found = httpx.get(url + "/admin/audit", headers=OPERATOR, timeout=30).json()["changes"]
        whats = {(c["what"], c["target"]) for c in found}
        wanted = {("batching", "shared"), ("tenant", "alpha"), ("keys", "keys.txt"), ("model file", "cached")}
        return found if wanted <= whats else None

    found = eventually(changes, 60, "not every change reached the audit trail", interval_s=0.5)
    by = {(c["what"], c["target"]): c for c in found}
    assert by[("batching", "shared")]["who"] == "key ops"
    assert by[("batching", "shared")]["new"] == {"max_wait_ms": 3.0}
    assert by[("tenant", "alpha")]["who"] == "admin" and by[("tenant", "alpha")]["new"] == {"max_queued": 6}
    assert by[("keys", "keys.txt")]["who"] == "file" and set(by[("keys", "keys.txt")]["new"]) == {"carol"}
    assert by[("model file", "cached")]["new"] == {"batching.max_wait_ms": 4.0}
    everything = str(found) + server.log()
    assert new_key not in everything and ALPHA not in everything and ADMIN not in everything  # never a secret
    assert '"event":"audit"' in server.log().replace(" ", "")
    assert httpx.get(url + "/admin/audit", headers={"X-API-Key": BRAVO}).status_code == 403
    # SIGHUP: the supervisor passes it to the engine; the check it asks for is recorded as its own.
    config["batching"]["max_wait_ms"] = 6
    yaml_path.write_text(yaml.safe_dump(config))
    os.kill(server.proc.pid, signal.SIGHUP)
    eventually(lambda: [c for c in httpx.get(url + "/admin/audit", headers=OPERATOR).json()["changes"]
                        if c["who"] == "SIGHUP" and c["target"] == "cached"], 30, "SIGHUP's reload is not in the trail")
    assert state(url)["audit"]  # the console's timeline has them


def test_processes_name_themselves_in_ps(drill) -> None:
    server, _, _ = drill

    def titles(pid: int) -> list[str]:
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                try:
                    found.append(Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode())
                except OSError:
                    continue
                found += titles(int(child))
        return found

    names = titles(server.proc.pid)
    assert "servewell engine" in names and "servewell ingress 0" in names, names
    assert {"servewell worker shared v1 #0", "servewell worker cached v1 #0"} <= set(names), names


def test_a_cold_start_shows_in_server_timing_and_the_slow_request_record(tmp_path: Path,
                                                                         start_server: ServerFactory) -> None:
    onnx_linear_model(tmp_path / "repo", "lazy")
    server = start_server(["--model-repository", str(tmp_path / "repo"), "--repository-mode", "lazy",
                           "--slow-request-ms", "1"])
    server.wait_live()
    answer = httpx.post(server.url + "/v2/models/lazy/infer", json=infer_body(1.0), headers={"X-Request-ID": "cold"},
                        timeout=120)
    assert answer.status_code == 200, answer.text
    load = re.search(r"load;dur=(\d+\.\d+)", answer.headers["server-timing"])
    assert load and float(load.group(1)) > 10, answer.headers["server-timing"]  # a load takes a while
    warm = httpx.post(server.url + "/v2/models/lazy/infer", json=infer_body(2.0), timeout=60)
    assert "load;dur" not in warm.headers["server-timing"]

    def record() -> dict[str, Any] | None:
        recent = httpx.get(server.url + "/console/api/state?recent=50").json()["recent"]
        return next((r for r in recent if r["request_id"] == "cold"), None)

    cold = eventually(record, 30, "the cold request was not recorded")
    assert cold["stages_ms"]["load"] > 10


def wait(driver: Any, condition: Any, timeout_s: float = 60) -> Any:
    return WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(condition)


def test_the_console_page_names_each_cause_and_shows_the_views(drill, browser) -> None:
    server, _, _ = drill
    for model, cause in (("shared", "tenant_holds_lane"), ("cached", "cache_ttl_short"), ("leaky", "worker_replaced")):
        diagnosed(server.url, model, cause)
    browser.get(server.url + "/")
    wait(browser, lambda d: d.find_element(By.ID, "auth").is_displayed())
    browser.find_element(By.ID, "auth-admin").send_keys(ADMIN)
    browser.find_element(By.CSS_SELECTOR, "#auth-form button[type=submit]").click()

    def text(selector: str) -> str:
        found: str = browser.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", selector)
        return found

    # Each model's reading on the page, with its evidence and what to do.
    wait(browser, lambda d: "one tenant fills the queue" in text('.diagnosis[data-model="shared"]'))
    wait(browser, lambda d: "TTL (0.5 s) is shorter" in text('.diagnosis[data-model="cached"]'))
    wait(browser, lambda d: "worker replaced (memory)" in text('.diagnosis[data-model="leaky"]'))
    assert "PATCH /admin/tenants/alpha" in text('.diagnosis[data-model="shared"]')
    # Tenants: alpha's status, its refusals by model, lane and reason, who holds the places.
    wait(browser, lambda d: text('#tenants-table tr[data-tenant="alpha"] .tenant-status') in ("refused", "failing"))
    assert "overloaded" in text('#refusals-table tr[data-tenant="alpha"][data-model="shared"]')
    # The cache panel, the memory table, the timeline with the changes and the replacements.
    assert "0.5 s" in text('.cache-model[data-model="cached"]')
    wait(browser, lambda d: text('#memory-table tr[data-process="worker leaky v1 #0"]'))
    assert "engine" in text("#memory-table") and "resident set size" in text("#memory-note")
    wait(browser, lambda d: "leaky #0: memory" in text("#changes-list"))
    assert browser.execute_script("return window.servewellConsole.marks.length") > 0  # lined up with the charts
    assert "restart" in text('#models tr[data-model="leaky"]')
    assert console_problems(browser) == []
