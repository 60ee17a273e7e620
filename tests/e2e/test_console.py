"""The live console at `/`, in a real headless Chromium against the real server: it loads without
console errors, its charts draw live data, failed requests are listed by request id, the try-it
panel reads the example 3, and the page and its JSON follow the API-key and admin rules. An
"incident" server (a fast, a slow, a failing and a broken model) checks what on-call needs: the
badge says degraded and why, the models table carries each model's req/s, p50/p99, error ratio
and p99 split, 4xx answers count in the outcome chart, the server's own alerts show in /healthz
and the console, and the recent table fits a 1,400 px screen."""

from __future__ import annotations

import base64
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from tritonclient.utils import InferenceServerException

from browser import console_problems, headless_chromium
from model_dirs import factory_model, infer_body, slow_model
from servewell.observability.recent_requests import DEFAULT_REFUSAL_CAPACITY
from waiting import eventually

IMAGE_PATH = Path(__file__).parents[2] / "src/servewell/examples/images/digit-3-200px.jpg"
IMAGE_B64 = base64.b64encode(IMAGE_PATH.read_bytes()).decode()
KEY = "console-key-0123456789abcdef"
ADMIN = "console-admin-token-0123456789"
SUCCESS_RGB = (0x1A, 0x7F, 0x37)  # console.js COLORS.success
P50_RGB = (0x25, 0x63, 0xEB)  # console.js COLORS.p50

MAX_SUCCESS_RATE = """
const u = window.servewellConsole.charts.requests;
if (!u) return null;
const i = u.series.findIndex((s) => s.label === 'success');
return Math.max(0, ...u.data[i].filter((v) => v !== null));
"""
# Pixels of one colour on a chart's canvas, above a y value (the rate 0 line: only a rate above 0
# puts the success colour there).
PIXELS_ABOVE = """
const [chart, rgb, above] = arguments;
const u = window.servewellConsole.charts[chart];
const canvas = u.ctx.canvas;
const limit = above === null ? canvas.height : Math.round(u.valToPos(above, 'y', true)) - 3;
const d = u.ctx.getImageData(0, 0, canvas.width, canvas.height).data;
let n = 0;
for (let y = 0; y < limit; y++) {
  for (let x = 0; x < canvas.width; x++) {
    const k = (y * canvas.width + x) * 4;
    if (Math.abs(d[k] - rgb[0]) <= 12 && Math.abs(d[k + 1] - rgb[1]) <= 12 && Math.abs(d[k + 2] - rgb[2]) <= 12
        && d[k + 3] > 200) n++;
  }
}
return n;
"""


@pytest.fixture
def browser(tmp_path):
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        yield driver
    finally:
        driver.quit()


def predict(url: str, headers: dict[str, str] | None = None, body: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/predict", json=body or {"image_base64": IMAGE_B64}, headers=headers, timeout=30)


def wait(driver, condition, timeout_s: float = 30):
    return WebDriverWait(driver, timeout_s, poll_frequency=0.25).until(condition)


def test_console_shows_models_live_charts_and_failed_requests(digits_server, browser):
    url = digits_server.url
    bad_id = f"console-e2e-{uuid.uuid4().hex[:12]}"
    assert predict(url, {"X-Request-ID": bad_id}, {"image_base64": "not base64!"}).status_code == 400
    browser.get(url + "/")
    wait(browser, lambda d: d.execute_script("return window.servewellConsole.polls") >= 1)
    for _ in range(30):  # live traffic while the page watches, spread over more than one sample
        assert predict(url).status_code == 200
        time.sleep(0.05)

    # The chart's data (what the page holds) shows the requests, and the canvas drew them.
    wait(browser, lambda d: (d.execute_script(MAX_SUCCESS_RATE) or 0) > 0)
    # The canvas is drawn after the data arrives (uPlot redraws on the next frame): wait for the pixels
    # too, rather than read them in the same instant (that raced once in a full run).
    wait(browser, lambda d: d.execute_script(PIXELS_ABOVE, "requests", SUCCESS_RGB, 0) > 10)
    wait(browser, lambda d: d.execute_script(PIXELS_ABOVE, "latency", P50_RGB, None) > 10)
    latency = browser.execute_script("return window.servewellConsole.charts.latency.data[1]")
    assert any(v is not None and 0 < v < 30_000 for v in latency)

    # One read of the row's text: the table is rebuilt on every poll, so an element found first and
    # read later can be gone (StaleElementReferenceException in a full run).
    row_text = browser.execute_script(
        "return document.querySelector('#models tr[data-model=\"digits\"]').innerText")
    assert "ready" in row_text and re.search(r"#0 pid \d+ · [\d.]+ MB", row_text)
    assert re.search(r"high \d+", row_text) and re.search(r"normal \d+", row_text)  # queue per lane

    # The failed request is listed with its code, found by its request id.
    browser.find_element(By.ID, "recent-filter").send_keys(bad_id)
    # Read in one go: the table is rebuilt on every poll (a row found, then read, can be gone).
    text = wait(browser, lambda d: d.execute_script(
        "const r = document.querySelector(arguments[0]); return r ? r.innerText : null",
        f'#recent-table tr[data-request-id="{bad_id}"]'))
    assert "400 bad_request" in text and "/predict" in text
    assert console_problems(browser) == []


def test_try_it_reads_the_example_digit(digits_server, browser, tmp_path):
    browser.get(digits_server.url + "/")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#try-model option[value="digits"]'))
    browser.find_element(By.ID, "try-file").send_keys(str(IMAGE_PATH))  # the input the drop zone feeds too
    top = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#try-topk li:first-child .label"))
    wait(browser, lambda d: top.text != "")
    assert top.text == "3"
    request_id = browser.find_element(By.ID, "try-request-id").text
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    last = browser.execute_script("return window.servewellConsole.lastTry")
    assert last["status"] == 200 and last["requestId"] == request_id and last["result"]["label"] == "3"
    waterfall = browser.find_element(By.ID, "try-waterfall").text
    for stage in ("preprocess", "queue", "compute", "postprocess", "server total", "browser round trip"):
        assert stage in waterfall
    assert set(last["stages"]) == {"preprocess", "queue", "compute", "postprocess", "total"}
    assert console_problems(browser) == []
    shot = tmp_path / "console.png"
    browser.execute_script("window.scrollTo(0, 0)")
    assert browser.save_screenshot(str(shot))
    if os.environ.get("SERVEWELL_CONSOLE_SCREENSHOT"):  # how docs/console.png is made
        shutil.copy(shot, os.environ["SERVEWELL_CONSOLE_SCREENSHOT"])


def test_grpc_failures_reach_the_console_list(digits_server):
    with triton.InferenceServerClient(digits_server.grpc_url) as client:
        x = triton.InferInput("input", [1, 1, 8, 8], "FP32")
        x.set_data_from_numpy(np.zeros((1, 1, 8, 8), np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("no-such-model", [x], headers={"x-request-id": "console-grpc-miss"})
        wrong = triton.InferInput("not-an-input", [1, 1, 8, 8], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 1, 8, 8), np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("digits", [wrong], headers={"x-request-id": "console-grpc-bad-input"})
    state = httpx.get(digits_server.url + "/console/api/state?recent=200").json()
    (record,) = [r for r in state["recent"] if r["request_id"] == "console-grpc-bad-input"]
    assert (record["protocol"], record["route"], record["status"], record["model"]) == (
        "grpc", "grpc ModelInfer", 422, "digits")
    # A request naming no model of this server is a refusal: counted and kept apart from the list.
    (miss,) = [r for r in state["refusals"]["recent"] if r["request_id"] == "console-grpc-miss"]
    assert (miss["protocol"], miss["route"], miss["status"], miss["code"]) == (
        "grpc", "grpc ModelInfer", 404, "not_found")
    assert state["refusals"]["counts"]["not_found"] >= 1
    assert not [r for r in state["recent"] if r["request_id"] == "console-grpc-miss"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, start_module_server, servewell_cache):
    """Keys and an admin token; every request counts as slow (1 ms), so successes are listed too."""
    server = start_module_server(["--cache-dir", str(servewell_cache), "--admin-token", ADMIN,
                                  "--slow-request-ms", "1"],
                          env={"SERVEWELL_API_KEYS": f"console:{KEY}"})
    server.wait_ready()
    return server


def test_console_json_follows_the_key_and_admin_rules(keyed):
    url = keyed.url
    page = httpx.get(url + "/")  # the page holds no data: open, like the docs
    assert page.status_code == 200 and 'data-keys-required="true"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/console/assets/[^"]+)"', page.text):
        assert httpx.get(url + asset).status_code == 200
    assert httpx.get(url + "/console/assets/..%2Fstate.py").status_code == 404
    assert httpx.get(url + "/console/assets/index.html").status_code == 404  # only the listed files

    assert httpx.get(url + "/console/api/state").status_code == 401  # the data: like inference
    assert httpx.get(url + "/console/api/state", headers={"X-API-Key": "wrong"}).status_code == 401
    ok = predict(url, {"X-API-Key": KEY, "X-Request-ID": "console-slow-ok"})
    assert ok.status_code == 200

    with_key = httpx.get(url + "/console/api/state", headers={"X-API-Key": KEY}).json()
    assert with_key["server"]["keys_required"] is True and with_key["server"]["admin"] is False
    assert "admin token" in with_key["server"]["admin_reason"] and with_key["server"]["tenant"] == "console"
    # A tenant's key sees its own tenant's requests (here every one is its own), not the server's counts.
    assert [r["client"] for r in with_key["recent"]] and {r["client"] for r in with_key["recent"]} == {"console"}
    assert with_key["recent_recorded"] is None and with_key["refusals"]["counts"] is None
    assert "batching" not in with_key["models"][0]
    (digits,) = [m for m in with_key["models"] if m["name"] == "digits"]
    assert digits["state"] == "ready" and digits["takes_images"] and digits["instances"][0]["rss_bytes"] > 0

    wrong_admin = {"X-API-Key": KEY, "Authorization": "Bearer not-the-token"}
    assert httpx.get(url + "/console/api/state", headers=wrong_admin).json()["server"]["admin"] is False
    token_only = httpx.get(url + "/console/api/state", headers={"Authorization": f"Bearer {ADMIN}"})
    assert token_only.status_code == 200 and token_only.json()["server"]["admin"] is True  # no tenant's key needed
    admin = httpx.get(url + "/console/api/state", headers={"X-API-Key": KEY, "Authorization": f"Bearer {ADMIN}"}).json()
    assert admin["server"]["admin"] is True and admin["models"][0]["batching"]["policy"]
    (slow,) = [r for r in admin["recent"] if r["request_id"] == "console-slow-ok"]
    assert slow["slow"] and slow["status"] == 200 and slow["route"] == "/predict" and slow["model"] == "digits"
    assert set(slow["stages_ms"]) == {"preprocess", "queue", "compute", "postprocess"}
    assert IMAGE_B64[:40] not in str(admin)  # no payloads

    assert httpx.get(url + "/console/api/state?model=nope", headers={"X-API-Key": KEY}).status_code == 404
    series = httpx.get(url + "/console/api/state?model=digits", headers={"X-API-Key": KEY}).json()["series"]
    assert series["model"] == "digits" and series["enabled"] and "success" in series["columns"]


def test_the_page_asks_for_the_key_and_then_shows_everything(keyed, browser):
    browser.get(keyed.url + "/")
    wait(browser, lambda d: d.find_element(By.ID, "auth").is_displayed())
    assert "needs an API key" in browser.find_element(By.ID, "live").text
    assert browser.execute_script("return window.servewellConsole.polls") == 0  # never asked without a key
    browser.find_element(By.ID, "auth-key").send_keys(KEY)
    browser.find_element(By.ID, "auth-admin").send_keys(ADMIN)
    browser.find_element(By.CSS_SELECTOR, "#auth-form button[type=submit]").click()
    row = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#models tr[data-model="digits"]'))
    assert "ready" in row.text
    browser.find_element(By.ID, "try-file").send_keys(str(IMAGE_PATH))  # the try-it panel sends the key too
    wait(browser, lambda d: (d.execute_script("return window.servewellConsole.lastTry") or {}).get("result"))
    request_id = browser.execute_script("return window.servewellConsole.lastTry.requestId")
    # The admin token opens the list; every request here is slow (1 ms), so the try-it one is in it.
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#recent-table tr[data-request-id="{request_id}"]'))
    assert console_problems(browser) == []


def test_a_tenants_key_shows_its_own_requests_and_the_admin_token_alone_opens_the_rest(keyed, browser):
    # Issue 45, H2: a tenant's key sees its own tenant's requests (the note says so), one tenants row;
    # an operator needs no tenant's key beside the admin token.
    own = predict(keyed.url, {"X-API-Key": KEY, "X-Request-ID": "console-own-request"})
    assert own.status_code == 200
    browser.get(keyed.url + "/")
    wait(browser, lambda d: d.find_element(By.ID, "auth").is_displayed())
    browser.find_element(By.ID, "auth-key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#auth-form button[type=submit]").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#recent-table tr[data-request-id="console-own-request"]'))
    assert "Tenant console's own requests only" in browser.find_element(By.ID, "recent-note").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#tenants-table tbody tr")
    assert [r.find_element(By.TAG_NAME, "code").text for r in rows] == ["console"]

    browser.find_element(By.ID, "auth-open").click()
    browser.find_element(By.ID, "auth-forget").click()
    browser.find_element(By.ID, "auth-admin").send_keys(ADMIN)  # the token only, no key
    browser.find_element(By.CSS_SELECTOR, "#auth-form button[type=submit]").click()
    wait(browser, lambda d: "recorded since the server started" in d.find_element(By.ID, "recent-note").text)
    assert browser.execute_script("return window.servewellConsole.state.server.admin") is True
    assert console_problems(browser) == []


def _admin_state(url: str) -> dict:
    headers = {"X-API-Key": KEY, "Authorization": f"Bearer {ADMIN}"}
    return httpx.get(url + "/console/api/state?recent=200", headers=headers).json()


def test_unauthenticated_requests_do_not_evict_a_real_failure(keyed):
    url = keyed.url
    failure_id = f"console-real-failure-{uuid.uuid4().hex[:8]}"
    failed = predict(url, {"X-API-Key": KEY, "X-Request-ID": failure_id}, {"image_base64": "not base64!"})
    assert failed.status_code == 400
    before = _admin_state(url)["refusals"]["counts"]
    with httpx.Client(base_url=url, timeout=30) as client:
        statuses = {client.post("/predict", json={}, headers={"X-Request-ID": f"anon-{i}"}).status_code
                    for i in range(250)}
    assert statuses <= {401, 429}
    state = _admin_state(url)
    assert failure_id in [r["request_id"] for r in state["recent"]]  # 250 refusals; the ring holds 200
    assert not [r for r in state["recent"] if r["status"] in (401, 429)]
    counts = state["refusals"]["counts"]
    refused = sum(counts.get(code, 0) - before.get(code, 0) for code in ("unauthorized", "over_quota"))
    assert refused == 250
    assert state["refusals"]["recent"][0]["request_id"] == "anon-249"  # newest first
    assert len(state["refusals"]["recent"]) == DEFAULT_REFUSAL_CAPACITY  # bounded: 250 came


def test_records_name_their_batch_and_compute_is_shown_by_batch_size(keyed):
    url = keyed.url
    for rows in (1, 3):  # one after the other: each request is its own batch
        tensor = {"name": "input", "shape": [rows, 1, 8, 8], "datatype": "FP32", "data": [0.0] * (64 * rows)}
        body = {"inputs": [tensor]}
        r = httpx.post(url + "/v2/models/digits/infer", json=body, timeout=30,
                       headers={"X-API-Key": KEY, "X-Request-ID": f"console-batch-{rows}"})
        assert r.status_code == 200, r.text
    state = _admin_state(url)
    records = {r["request_id"]: r for r in state["recent"] if r["request_id"].startswith("console-batch-")}
    one, three = records["console-batch-1"], records["console-batch-3"]  # slow: every request is, here
    assert (one["batch_size"], three["batch_size"]) == (1, 3)
    assert isinstance(one["batch_id"], int) and isinstance(three["batch_id"], int)
    assert one["batch_id"] != three["batch_id"]
    assert one["instance"] == three["instance"] == 0
    assert one["queue_position"] == three["queue_position"] == 0  # nothing else was queued

    sizes = {"1", "2", "4", "8", "16", "32", "64"}  # digits: max_batch_size 64
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text  # an operator's
    labels = {sample.labels["batch_size"] for family in text_string_to_metric_families(metrics)
              if family.name == "servewell_batch_compute_by_size_seconds" for sample in family.samples
              if sample.labels.get("model") == "digits"}
    assert {"1", "4"} <= labels <= sizes  # a batch of 3 counts under 4: the label set stays bounded
    (digits,) = [m for m in state["models"] if m["name"] == "digits"]
    by_size = {row["batch_size"]: row for row in digits["compute_by_batch_size"]}
    assert {1, 4} <= set(by_size) and {str(size) for size in by_size} <= sizes
    assert by_size[4]["count"] >= 1 and 0 < by_size[4]["p50_ms"] <= by_size[4]["p99_ms"]


# ---------- the incident server: what an on-call engineer needs to see ----------

FAILS = """
from torch import nn


class Fails(nn.Linear):
    def forward(self, x):
        if bool((x != 0).any()):  # the warm-up's zeros pass: the model loads, then fails every request
            raise RuntimeError("this model fails every batch")
        return x


def build():
    return Fails(1, 1)
"""
SLOW_MS = 250  # far above what the 1 ms model takes, even on a busy machine


@pytest.fixture(scope="module")
def incident(tmp_path_factory, start_module_server):
    """fast (1 ms a batch), slow (250 ms), fails (every batch raises) and broken (not an ONNX graph:
    failed, so the server is degraded); alerts evaluated every second."""
    root = tmp_path_factory.mktemp("incident-models")
    slow_model(root, "fast", 1.0, max_batch_size=4)
    slow_model(root, "slow", float(SLOW_MS), max_batch_size=4)
    factory_model(root, "fails", FAILS)
    (root / "broken").mkdir()
    (root / "broken" / "model.onnx").write_bytes(b"this is not an onnx graph")
    (root / "broken" / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}))
    config = tmp_path_factory.mktemp("incident-config") / "config.yaml"
    config.write_text(yaml.safe_dump({"alerting": {"evaluation_interval_s": 1.0}}))
    server = start_module_server(["--model-repository", str(root), "--config", str(config)])
    server.wait_live()

    def settled() -> bool:  # wait_ready would refuse the broken model
        models = httpx.get(server.url + "/healthz", timeout=5).json()["models"]
        states = {n: m["state"] for n, m in models.items()}
        if "loading" in states.values():
            return False
        assert states == {"broken": "failed", "fast": "ready", "slow": "ready", "fails": "ready"}, models
        return True

    eventually(settled, 180, lambda: f"the models settled: {server.log()[-2000:]}")
    return server


def infer(url: str, model: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body or infer_body(1.0), timeout=30)


class Traffic:
    """Requests to each model on a thread until stopped (at most `limit_s`): alerts judge every
    evaluation window, so the failures must go on while the test looks."""

    def __init__(self, url: str, models: tuple[str, ...], limit_s: float = 60.0) -> None:
        self.stop = threading.Event()
        self.answers: list[int] = []

        def run() -> None:
            deadline = time.monotonic() + limit_s
            while not self.stop.is_set() and time.monotonic() < deadline:
                for model in models:
                    self.answers.append(infer(url, model).status_code)
                time.sleep(0.02)

        self.thread = threading.Thread(target=run, daemon=True)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def state(url: str, model: str = "*") -> dict:
    return httpx.get(f"{url}/console/api/state?model={model}", timeout=10).json()


def models_of(doc: dict) -> dict[str, dict]:
    return {m["name"]: m for m in doc["models"]}


def test_the_badge_shows_degraded_with_the_reason(incident, browser):
    health = httpx.get(incident.url + "/healthz").json()
    assert health["status"] == "degraded" and "broken" in health["readiness"]["reason"]
    browser.get(incident.url + "/")
    badge = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#server-ready[data-status="degraded"]'))
    assert badge.text == "degraded" and "degraded" in badge.get_attribute("class").split()
    assert "broken" in browser.find_element(By.ID, "server-reason").text
    assert console_problems(browser) == []


ROW_CELLS = """
const row = document.querySelector(`#models tr[data-model="${arguments[0]}"]`);
const cells = {};
for (const td of row.querySelectorAll('td.num')) cells[td.classList[1]] = td.textContent;
const split = document.querySelector(`#models tr.split-row[data-model="${arguments[0]}"]`);
return [cells, row.textContent + ' ' + split.textContent];
"""


def test_each_model_row_has_its_rate_latency_errors_and_p99_split(incident, browser):
    with Traffic(incident.url, ("fast", "slow", "fails")):
        def measured():
            models = models_of(state(incident.url))
            signals = [models[n]["signals"] for n in ("fast", "slow", "fails")]
            if all(s and s["latency_p99_ms"] for s in signals) and signals[2]["error_ratio"]:
                return models
            return None

        models = eventually(measured, 40, "every model's p99 and the failing model's error ratio")
        browser.get(incident.url + "/")
        wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#models tr[data-model="slow"] td.p99.worst'))
        # Read in one go: the table is redrawn every poll.
        cells, row_text = browser.execute_script(ROW_CELLS, "slow")
    fast, slow, fails = models["fast"], models["slow"], models["fails"]
    assert slow["signals"]["latency_p99_ms"] >= SLOW_MS and slow["signals"]["latency_p99_ms"] > fast["signals"][
        "latency_p99_ms"]
    assert slow["signals"]["requests_per_s"] > 0 and fast["signals"]["error_ratio"] == 0
    assert fails["signals"]["error_ratio"] == 1.0
    split = slow["latency_split"]
    assert split["p99_ms"] == slow["signals"]["latency_p99_ms"] and split["compute_ms"] >= SLOW_MS * 0.8
    assert split["reading"] and set(split) == {"p99_ms", "queue_ms", "compute_ms", "preprocess_ms", "postprocess_ms",
                                               "reading", "cause"}
    # No earlier cause: the model's reading is the stages' (or, with too few requests, says it cannot tell).
    assert slow["diagnosis"]["cause"] in ("compute", "unknown"), slow["diagnosis"]
    assert re.fullmatch(r"[\d.]+ (ms|s)", cells["p99"]) and re.fullmatch(r"[\d.]+", cells["rps"])
    assert cells["errors"] == "0.0%"
    assert "compute" in row_text and split["reading"] in row_text
    assert "What to do:" in row_text  # the model's reading, with its advice, under the split
    assert console_problems(browser) == []


def test_4xx_answers_count_in_the_requests_by_outcome_chart(incident, browser):
    wrong = {"inputs": [{"name": "nope", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    for _ in range(20):
        assert infer(incident.url, "fast", wrong).status_code == 422
    # An unknown model is a client error too; it counts among all models.
    assert infer(incident.url, "no-such-model").status_code == 404
    eventually(lambda: max(state(incident.url, "fast")["series"]["columns"]["client_error"], default=0) > 0,
               40, "a client_error point in the fast model's series")
    browser.get(incident.url + "/")
    chart_max = """
const u = window.servewellConsole.charts.requests;
if (!u) return null;
const i = u.series.findIndex((s) => s.label === 'client error (4xx)');
return i < 0 ? -1 : Math.max(0, ...u.data[i].filter((v) => v !== null));
"""
    assert wait(browser, lambda d: (d.execute_script(chart_max) or 0) > 0)
    assert console_problems(browser) == []


def test_the_servers_own_alerts_show_in_healthz_and_the_console(incident, browser):
    # Would notice: nothing fails before this test's traffic. An earlier test's failures of `fails` keep
    # the alert firing until they leave the signals' window, so wait for that first.
    eventually(lambda: httpx.get(incident.url + "/healthz").json()["alerts"] == [], 120,
               "the alerts of an earlier test's traffic did not clear")
    with Traffic(incident.url, ("fast", "slow", "fails")) as traffic:
        def alert():
            found = [a for a in httpx.get(incident.url + "/healthz").json()["alerts"]
                     if (a["name"], a["model"]) == ("error_ratio", "fails")]
            return found[0] if found else None

        fired = eventually(alert, 40, "the error_ratio alert of model fails in /healthz")
        health = httpx.get(incident.url + "/healthz")
        assert health.status_code == 200 and health.json()["status"] == "degraded"  # readiness unchanged
        assert fired["prometheus"] == "ServewellHighErrorRatio" and fired["severity"] == "critical"
        assert fired["value"] == 1.0 and fired["threshold"] == 0.05 and fired["since"] <= time.time()
        assert "fails" in fired["summary"] and "/healthz" in fired["action"]
        assert any(a["name"] == "error_ratio" for a in state(incident.url)["alerts"])
        browser.get(incident.url + "/")
        item = wait(browser, lambda d: d.find_element(
            By.CSS_SELECTOR, '#alerts-list li[data-alert="error_ratio"][data-model="fails"]'))
        assert "critical" in item.text and "What to do" in item.text
        if os.environ.get("SERVEWELL_CONSOLE_SCREENSHOT"):  # the incident view: docs/console-incident.png
            wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#models tr[data-model="slow"] td.p99.worst'))
            time.sleep(4)  # two more points on the charts
            browser.execute_script("window.scrollTo(0, 0)")
            browser.save_screenshot(os.environ["SERVEWELL_CONSOLE_SCREENSHOT"].replace(".png", "-incident.png"))
    assert set(traffic.answers) == {200, 500}
    assert console_problems(browser) == []


RECT = """
const el = arguments[0];
const r = el.getBoundingClientRect();
const box = el.closest('.scroll').getBoundingClientRect();
return [r.left, r.right, box.right, document.documentElement.clientWidth];
"""


def test_the_recent_table_fits_a_1400_px_screen(incident, tmp_path):
    for _ in range(3):  # failed requests fill the recent table (a loopback client sees it)
        assert infer(incident.url, "fails").status_code == 500
    driver = headless_chromium(tmp_path / "narrow-profile", width=1400, height=1000)
    try:
        driver.get(incident.url + "/")
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#recent-table tbody tr[data-request-id]"))
        assert driver.execute_script("return window.innerWidth") == 1400
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#models tr[data-model="slow"]'))
        headers = driver.find_elements(By.CSS_SELECTOR, "#recent-table thead th")
        model_headers = driver.find_elements(By.CSS_SELECTOR, "#models thead th")
        cells = driver.find_elements(By.CSS_SELECTOR, "#recent-table tbody tr[data-request-id]:first-child td")
        assert [h.text for h in headers][-3:] == ["total", "stages", "batch"]
        assert [h.text for h in model_headers][-1] == "errors"
        for element in (*headers, *cells, *model_headers):
            left, right, box_right, viewport = driver.execute_script(RECT, element)
            assert 0 <= left and right <= box_right + 0.5 and right <= viewport, (element.text, right, box_right)
        assert console_problems(driver) == []
    finally:
        driver.quit()
