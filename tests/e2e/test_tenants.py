"""Tenants (issue 22) through a real split server with two ingress processes and a keys file:
quotas hold for the whole server (429 over_quota with Retry-After, distinct from the model's own
503), a heavy tenant waits behind itself, the admin API shows and changes tenants live, a keys
file change applies live, and the console filters recent requests by tenant. A second server
(two tenants, an operator key, no admin token) keeps tenants apart in every view (issue 45, H2).

`slow` echoes its input after 200 ms per batch, one row a batch, so every request is a batch and
the order of answers is the order the scheduler chose."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from error_bodies import error_code
from model_dirs import infer_body, slow_model
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from waiting import eventually

ADMIN = "tenants-admin-token-0123456789"
KEYS = {name: f"{name}-secret-0123456789abcdef" for name in ("gold", "bulk", "light", "capped", "paced")}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
KEYS_FILE = (
    f"gold:{KEYS['gold']} tenant=gold weight=4 concurrency=3\n"
    f"bulk:{KEYS['bulk']} tenant=shared\n"
    f"light:{KEYS['light']} tenant=light\n"
    f"capped:{KEYS['capped']} queue=2\n"
    f"paced:{KEYS['paced']} rate=2\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("tenants-repo")
    slow_model(root, "slow", 200, max_batch_size=1, batching={"max_queue_size": 256})
    keys_file = tmp_path_factory.mktemp("tenant-keys") / "keys.txt"
    keys_file.write_text(KEYS_FILE)
    started = start_module_server(["--model-repository", str(root), "--ingress-processes", "2",
                                   "--api-keys-file", str(keys_file), "--admin-token", ADMIN,
                                   "--config-poll-s", "0.3", "--slow-request-ms", "50"])
    started.wait_ready()
    started.keys_file = keys_file  # type: ignore[attr-defined]
    return started


async def burst(server: ServerProcess, key: str, count: int, value: float = 1.0) -> list[httpx.Response]:
    """`count` requests at once, each on its own connection (spread over both ingress processes)."""
    async def one() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await client.post("/v2/models/slow/infer", json=infer_body(value), headers={"X-API-Key": key})

    return list(await asyncio.gather(*(one() for _ in range(count))))


def tenants(server: ServerProcess) -> dict[str, dict[str, Any]]:
    doc = httpx.get(server.url + "/admin/tenants", headers=ADMIN_AUTH, timeout=10).json()
    return {t["tenant"]: t for t in doc["tenants"]}


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    return scraped_total(server.url, name, headers=ADMIN_AUTH, **labels)  # with keys: an operator's


def test_a_concurrency_quota_holds_across_ingress_processes(server: ServerProcess) -> None:
    answers = asyncio.run(burst(server, KEYS["gold"], 8))
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(refused) == 8 and 1 <= len(ok) <= 3, [a.status_code for a in answers]
    for answer in refused:
        assert error_code(answer) == "over_quota" and int(answer.headers["retry-after"]) >= 1
        assert "concurrency quota" in answer.json()["error"]
    assert tenants(server)["gold"]["over_concurrency"] == len(refused)
    assert metric(server, "servewell_tenant_requests_total", tenant="gold", result="over_concurrency") == len(refused)


def test_a_queue_quota_counts_this_tenants_queued_requests(server: ServerProcess) -> None:
    answers = asyncio.run(burst(server, KEYS["capped"], 8))
    codes = sorted(a.status_code for a in answers)
    assert 200 in codes and 429 in codes, codes
    assert codes.count(200) <= 3  # at most one running and two queued at any time
    refused = [a for a in answers if a.status_code == 429]
    assert all("requests queued for model 'slow'" in a.json()["error"] for a in refused)


def test_a_rate_quota_is_one_bucket_for_the_whole_server(server: ServerProcess) -> None:
    started = time.monotonic()
    answers = asyncio.run(burst(server, KEYS["paced"], 8))
    elapsed = time.monotonic() - started
    ok = sum(a.status_code == 200 for a in answers)
    assert ok <= 2 + 2 * elapsed + 1, (ok, elapsed)  # a burst of 2, then 2 a second (each ingress alone would allow 4)
    assert all(a.status_code in (200, 429) for a in answers)
    assert all(int(a.headers["retry-after"]) >= 1 for a in answers if a.status_code == 429)


def test_a_heavy_tenant_waits_behind_itself(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[str], float]:
        order: list[str] = []

        async def send(client: httpx.AsyncClient, key: str, tag: str) -> None:
            response = await client.post("/v2/models/slow/infer", json=infer_body(2.0), headers={"X-API-Key": key})
            assert response.status_code == 200, response.text
            order.append(tag)

        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            heavy = [asyncio.create_task(send(c, KEYS["bulk"], "bulk")) for _ in range(16)]
            await asyncio.sleep(0.5)  # the bulk tenant's 16 are queued (3.2 s of work)
            started = time.monotonic()
            await send(c, KEYS["light"], "light")
            light_s = time.monotonic() - started
            await asyncio.gather(*heavy)
        return order, light_s

    order, light_s = asyncio.run(scenario())
    # First in, first out, the light request would wait for every bulk request queued before it.
    assert order.index("light") <= 5, order
    assert light_s < 1.5


def test_the_admin_api_changes_a_tenant_live_until_the_keys_file_changes(server: ServerProcess) -> None:
    before = tenants(server)
    assert before["gold"]["weight"] == 4 and before["gold"]["max_concurrent"] == 3
    assert before["shared"]["weight"] == 1 and before["capped"]["max_queued"] == 2
    patched = httpx.patch(server.url + "/admin/tenants/gold", json={"max_concurrent": 10, "weight": 2},
                          headers=ADMIN_AUTH, timeout=10)
    assert patched.status_code == 200, patched.text
    assert patched.json()["max_concurrent"] == 10 and patched.json()["overrides"] == {"max_concurrent": 10, "weight": 2}
    answers = asyncio.run(burst(server, KEYS["gold"], 6))
    assert all(a.status_code == 200 for a in answers)  # 6 at once: within the new quota
    for body, status in (({"weight": 0}, 422), ({"max_queued": "many"}, 422), ({}, 422), ({"color": 1}, 422)):
        answer = httpx.patch(server.url + "/admin/tenants/gold", json=body, headers=ADMIN_AUTH, timeout=10)
        assert answer.status_code == status, (body, answer.text)
    assert httpx.patch(server.url + "/admin/tenants/nobody", json={"weight": 2}, headers=ADMIN_AUTH,
                       timeout=10).status_code == 404
    assert httpx.patch(server.url + "/admin/tenants/gold", json={"weight": 2}, timeout=10,
                       headers={"Authorization": f"Bearer {KEYS['gold']}"}).status_code == 403  # a tenant's key
    keys_file: Path = server.keys_file  # type: ignore[attr-defined]
    keys_file.write_text(KEYS_FILE.replace("weight=4 concurrency=3", "weight=8 concurrency=3"))
    eventually(lambda: tenants(server)["gold"]["weight"] == 8, 30, "the keys file change never applied")
    after = tenants(server)["gold"]
    assert after["max_concurrent"] == 3 and after["overrides"] == {}  # the file wins again


def test_the_console_filters_recent_requests_by_tenant(server: ServerProcess) -> None:
    asyncio.run(burst(server, KEYS["light"], 1))
    url = server.url + "/console/api/state"
    both = {**ADMIN_AUTH, "X-API-Key": KEYS["light"]}  # the console's data takes a key; recent requests, admin
    doc = httpx.get(url, params={"tenant": "light"}, headers=both, timeout=10).json()
    assert doc["recent"] and {r["client"] for r in doc["recent"]} == {"light"}
    assert {t["tenant"] for t in doc["tenants"]} >= {"gold", "shared", "light", "capped", "paced"}
    everyone = httpx.get(url, headers=both, timeout=10).json()
    assert len({r["client"] for r in everyone["recent"]}) > 1
    assert httpx.get(url, params={"tenant": "nobody"}, headers=both, timeout=10).status_code == 404


def test_a_quota_holds_over_grpc_too(server: ServerProcess) -> None:
    """gold's concurrency quota (3) counts gRPC and HTTP requests alike: with three HTTP requests in
    progress, a gRPC call is refused RESOURCE_EXHAUSTED with the over_quota code."""
    x = triton_grpc.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
    client = triton_grpc.InferenceServerClient(server.grpc_url)

    async def scenario() -> tuple[list[httpx.Response], InferenceServerException | None]:
        holding = asyncio.ensure_future(burst(server, KEYS["gold"], 3))
        async with httpx.AsyncClient(base_url=server.url, headers=ADMIN_AUTH, timeout=10) as admin:
            for _ in range(200):  # until the three are in progress (200 ms a batch, one row each)
                doc = (await admin.get("/admin/tenants")).json()
                if next(t for t in doc["tenants"] if t["tenant"] == "gold")["inflight"] == 3:
                    break
                await asyncio.sleep(0.01)
        refused = None
        try:
            await asyncio.to_thread(client.infer, "slow", [x], headers={"x-api-key": KEYS["gold"]})
        except InferenceServerException as exc:
            refused = exc
        return await holding, refused

    answers, refused = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200] * 3
    assert refused is not None and refused.status() == "StatusCode.RESOURCE_EXHAUSTED", refused
    assert "concurrency quota" in refused.message()


# ---------- tenants kept apart in every view (issue 45, H2) ----------

APART = {"acme": "acme-secret-0123456789abcdef", "bravo": "bravo-secret-0123456789abcdef",
         "ops": "operator-secret-0123456789abcdef"}
APART_FILE = (f"acme-key:{APART['acme']} tenant=acme\n"
              f"bravo-key:{APART['bravo']} tenant=bravo\n"
              f"ops:{APART['ops']} role=operator\n")
ACME_IDS = ["acme-private-0", "acme-private-1", "acme-private-bad", "acme-private-miss"]
BRAVO = {"X-API-Key": APART["bravo"]}
STATE = "/console/api/state?recent=200"


@pytest.fixture(scope="module")
def apart(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    """Two tenants (acme, bravo) and an operator key, and no admin token: a client on loopback is
    trusted (the default), which is where issue 45 found tenant b reading tenant a's requests.
    acme's requests are here before any test: two successes (every request is slow at 1 ms, so
    recorded), a failure and a refusal, each with a request id acme chose."""
    root = tmp_path_factory.mktemp("apart-repo")
    slow_model(root, "echo", 1)
    keys_file = tmp_path_factory.mktemp("apart-keys") / "keys.txt"
    keys_file.write_text(APART_FILE)
    started = start_module_server(["--model-repository", str(root), "--api-keys-file", str(keys_file),
                                   "--slow-request-ms", "1", "--config-poll-s", "0.3"])
    started.wait_ready()
    started.keys_file = keys_file  # type: ignore[attr-defined]
    with httpx.Client(base_url=started.url, headers={"X-API-Key": APART["acme"]}, timeout=30) as acme:
        for request_id, path, body, status in (
                ("acme-private-0", "/v2/models/echo/infer", infer_body(1.0), 200),
                ("acme-private-1", "/v2/models/echo/infer", infer_body(2.0), 200),
                ("acme-private-bad", "/v2/models/echo/infer", {"inputs": []}, 422),
                ("acme-private-miss", "/v2/models/nope/infer", infer_body(1.0), 404)):
            answer = acme.post(path, json=body, headers={"X-Request-ID": request_id})
            assert answer.status_code == status, answer.text
    assert httpx.post(started.url + "/v2/models/echo/infer", json=infer_body(3.0), timeout=30,
                      headers={**BRAVO, "X-Request-ID": "bravo-own-0"}).status_code == 200

    def all_recorded() -> bool:  # the ingress processes' records reach the engine's view
        doc = httpx.get(started.url + STATE, timeout=10).json()  # loopback, no token: an operator
        seen = {r["request_id"] for r in doc["recent"] + doc["refusals"]["recent"]}
        return {*ACME_IDS, "bravo-own-0"} <= seen

    eventually(all_recorded, 30, "the requests recorded")
    return started


def test_a_tenants_key_sees_its_own_requests_and_figures_and_no_other_tenants(apart: ServerProcess) -> None:
    doc = httpx.get(apart.url + STATE, headers=BRAVO, timeout=10).json()
    text = json.dumps(doc)
    assert "acme" not in text and '"ops"' not in text  # no request id, key id or tenant of anyone else
    assert doc["server"]["admin"] is False and doc["server"]["tenant"] == "bravo"
    assert "operator key" in doc["server"]["admin_reason"]
    assert "bravo-own-0" in [r["request_id"] for r in doc["recent"]]
    assert {r["client"] for r in doc["recent"]} == {"bravo-key"}
    assert [t["tenant"] for t in doc["tenants"]] == ["bravo"] and doc["tenants"][0]["admitted"] >= 1
    assert doc["recent_recorded"] is None and doc["refusals"]["counts"] is None  # the whole server's counts
    for other in ("acme", "nobody", "-"):  # 403 whether the tenant exists or not: no oracle
        refused = httpx.get(apart.url + STATE, params={"tenant": other}, headers=BRAVO, timeout=10)
        assert refused.status_code == 403 and "its own requests only" in refused.json()["error"]["message"]
    own = httpx.get(apart.url + STATE, params={"tenant": "bravo"}, headers=BRAVO, timeout=10)
    assert own.status_code == 200 and {r["client"] for r in own.json()["recent"]} == {"bravo-key"}


def test_a_tenants_key_opens_no_operator_route_even_from_loopback(apart: ServerProcess) -> None:
    routes = [("GET", "/metrics"), ("GET", "/admin/tenants"), ("GET", "/admin/config"),
              ("GET", "/admin/models/echo/batching"), ("GET", "/admin/models/echo/cache"),
              ("GET", "/admin/models/echo/rollout"), ("POST", "/admin/models/nope/pin"),
              ("POST", "/v2/repository/models/nope/unload")]
    for credentials in (BRAVO, {"Authorization": f"Bearer {APART['bravo']}"}):
        for method, path in routes:
            answer = httpx.request(method, apart.url + path, headers=credentials, timeout=10)
            assert answer.status_code == 403, (path, answer.status_code, answer.text[:300])
            assert "acme" not in answer.text and "tenant 'bravo'" in answer.text
    health = httpx.get(apart.url + "/healthz", headers=BRAVO, timeout=10).text  # open: holds no tenant data
    assert "acme" not in health and "bravo" not in health
    with triton_grpc.InferenceServerClient(apart.grpc_url) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.unload_model("nope", headers={"x-api-key": APART["bravo"]})
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED", refused.value
        with pytest.raises(InferenceServerException) as passed:  # the operator key gets past the rule
            client.unload_model("nope", headers={"authorization": f"Bearer {APART['ops']}"})
        assert passed.value.status() == "StatusCode.NOT_FOUND", passed.value


def test_an_operator_key_and_a_trusted_loopback_client_see_the_whole_server(apart: ServerProcess) -> None:
    for credentials in ({"X-API-Key": APART["ops"]}, {"Authorization": f"Bearer {APART['ops']}"}, {}):
        doc = httpx.get(apart.url + STATE, params={"tenant": "acme"}, headers=credentials, timeout=10).json()
        assert doc["server"]["admin"] is True and doc["server"]["tenant"] is None
        ids = {r["request_id"] for r in doc["recent"] + doc["refusals"]["recent"]}
        assert set(ACME_IDS) <= ids and {r["client"] for r in doc["recent"]} == {"acme-key"}
        assert {t["tenant"] for t in doc["tenants"]} >= {"acme", "bravo"}
        assert scraped_total(apart.url, "servewell_tenant_requests_total", headers=credentials,
                             tenant="acme", result="admitted") == 2  # the two that reached the model
        assert httpx.get(apart.url + "/admin/tenants", headers=credentials, timeout=10).status_code == 200
        assert httpx.post(apart.url + "/v2/repository/models/nope/unload", headers=credentials,
                          timeout=10).status_code == 404  # past the rule: the model is unknown
    assert httpx.get(apart.url + STATE, headers={"X-API-Key": "not-a-key-of-this-server"},
                     timeout=10).status_code == 401


def test_a_keys_file_with_one_key_twice_is_refused_and_healthz_names_no_key(apart: ServerProcess) -> None:
    # Issue 45 H7: bravo's key under a second id of tenant acme was accepted silently (the later won:
    # bravo's requests became acme's). Refused now, the keys in force kept; the reason names ids and
    # tenants, so the open /healthz says only that the file was refused.
    keys_file: Path = apart.keys_file  # type: ignore[attr-defined]
    keys_file.write_text(APART_FILE + f"acme-extra:{APART['bravo']} tenant=acme\n")
    eventually(lambda: apart.health()["config"]["rejected"], 20, "the keys file refused")
    health = apart.health()
    assert health["status"] == "degraded" and health["ready"] is True
    assert "acme" not in json.dumps(health) and "bravo" not in json.dumps(health)
    report = httpx.get(apart.url + "/admin/config", timeout=10).json()  # loopback, no token: an operator
    (reason,) = [r["reason"] for r in report["config"]["rejected"]]
    assert "the same key as" in reason and "'bravo-key' and 'acme-extra'" in reason and APART["bravo"] not in reason
    def admitted() -> dict[str, int]:
        doc = httpx.get(apart.url + "/admin/tenants", timeout=10).json()
        return {t["tenant"]: t["admitted"] for t in doc["tenants"]}

    before = admitted()
    answer = httpx.post(apart.url + "/v2/models/echo/infer", json=infer_body(1.0), timeout=30,
                        headers={**BRAVO, "X-Request-ID": "bravo-after-refused-file"})
    assert answer.status_code == 200
    after = admitted()  # still bravo's request, not acme's
    assert (after["bravo"] - before["bravo"], after["acme"] - before["acme"]) == (1, 0)
    keys_file.write_text(APART_FILE)
    eventually(lambda: apart.health()["status"] == "ok", 20, "the good keys file applied again")
