"""The response cache (issue 22) through a real split server with two ingress processes: a repeat
is answered without compute, identical requests in flight share one computation, the admin API
shows and empties a cache, a model.yaml change empties it live, and a model declared
non-deterministic is refused a cache (its load fails, naming why).

`cached` echoes its input after 400 ms per batch (max batch 1, so a second computation would
show as a second batch and as rows computed), with `cache:` in its model.yaml; `plain` is the
same model without a cache.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import yaml

from error_bodies import error_code
from model_dirs import infer_body, slow_model
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from waiting import eventually

CACHE = {"max_bytes": 1 << 20, "ttl_s": 600}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("cache-repo")
    slow_model(root, "cached", 400, max_batch_size=1, cache=CACHE)
    slow_model(root, "plain", 400, max_batch_size=1)
    started = start_module_server(["--model-repository", str(root), "--ingress-processes", "2"])
    started.wait_ready()
    started.root = root  # type: ignore[attr-defined]
    return started


def rows_computed(server: ServerProcess, model: str) -> int:
    health = httpx.get(server.url + "/healthz", timeout=10).json()
    return int(sum(i["rows_computed"] for i in health["models"][model]["instances"]))


def cache_doc(server: ServerProcess, model: str) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"{server.url}/admin/models/{model}/cache", timeout=10).json()
    return doc


def post(server: ServerProcess, model: str, value: float) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=infer_body(value), timeout=30)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    return scraped_total(server.url, name, None, **labels)


def test_a_repeat_is_answered_from_the_cache_without_compute(server: ServerProcess) -> None:
    before = rows_computed(server, "cached")
    first = post(server, "cached", 3.5)
    assert first.status_code == 200, first.text
    assert "cache;desc=miss" in first.headers["server-timing"]  # computed: a model with a cache says so
    assert rows_computed(server, "cached") == before + 1
    for _ in range(4):  # new connections: the ingress processes share the engine's one cache
        again = post(server, "cached", 3.5)
        assert again.status_code == 200
        assert again.json()["outputs"] == first.json()["outputs"]
        assert "cache;desc=hit" in again.headers["server-timing"]
    assert rows_computed(server, "cached") == before + 1
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    x = triton.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[3.5]], dtype=np.float32), binary_data=True)
    assert client.infer("cached", [x]).as_numpy("y").tolist() == [[3.5]]
    assert rows_computed(server, "cached") == before + 1
    assert metric(server, "servewell_response_cache_requests_total", model="cached", result="hit") >= 5
    assert metric(server, "servewell_response_cache_entries", model="cached") >= 1
    assert metric(server, "servewell_requests_total", model="cached", outcome="success") >= 6


def test_identical_requests_in_flight_share_one_computation(server: ServerProcess) -> None:
    before = rows_computed(server, "cached")
    coalesced = metric(server, "servewell_response_cache_requests_total", model="cached", result="coalesced")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            same = [client.post("/v2/models/cached/infer", json=infer_body(8.25)) for _ in range(6)]
            return await asyncio.gather(*same)

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * 6
    assert {a.json()["outputs"][0]["data"][0] for a in answers} == {8.25}
    # One computation; the rest shared it (or, arriving after it ended, hit the kept answer).
    assert rows_computed(server, "cached") == before + 1
    shared = [a for a in answers if "cache;desc=" in a.headers["server-timing"]
              and "cache;desc=miss" not in a.headers["server-timing"]]
    assert len(shared) == 5
    assert metric(server, "servewell_response_cache_requests_total", model="cached", result="coalesced") > coalesced


def test_a_model_without_a_cache_computes_every_request(server: ServerProcess) -> None:
    before = rows_computed(server, "plain")
    for _ in range(2):
        assert post(server, "plain", 1.0).status_code == 200
    assert rows_computed(server, "plain") == before + 2
    assert cache_doc(server, "plain") == {"model": "plain", "cache": None}
    refused = httpx.delete(f"{server.url}/admin/models/plain/cache", timeout=10)
    assert refused.status_code == 409 and "no response cache" in refused.json()["error"]["message"]


def test_the_admin_api_shows_and_empties_a_cache(server: ServerProcess) -> None:
    assert post(server, "cached", 2.0).status_code == 200
    doc = cache_doc(server, "cached")["cache"]
    assert doc["entries"] >= 1 and doc["bytes"] > 0 and doc["max_bytes"] == CACHE["max_bytes"]
    assert doc["hit"] >= 1 and doc["miss"] >= 1
    cleared = httpx.delete(f"{server.url}/admin/models/cached/cache", timeout=10)
    assert cleared.status_code == 200 and cleared.json()["dropped"] == doc["entries"]
    assert cleared.json()["cache"]["entries"] == 0
    before = rows_computed(server, "cached")
    assert post(server, "cached", 2.0).status_code == 200  # computed again
    assert rows_computed(server, "cached") == before + 1
    proxied = httpx.delete(f"{server.url}/admin/models/cached/cache", headers={"X-Forwarded-For": "203.0.113.9"},
                           timeout=10)
    assert proxied.status_code in (401, 403)  # not loopback once a proxy says so: no token, refused
    assert cache_doc(server, "cached")["cache"]["entries"] == 1


def test_an_admin_patch_changes_the_bounds_live(server: ServerProcess) -> None:
    url = f"{server.url}/admin/models/cached/cache"
    patched = httpx.patch(url, json={"max_bytes": 4096, "ttl_s": 30}, timeout=10)
    assert patched.status_code == 200, patched.text
    assert patched.json()["cache"]["max_bytes"] == 4096 and patched.json()["cache"]["bytes"] <= 4096
    for body in ({"max_bytes": 10}, {"ttl_s": -1}, {}, {"max_bytes": "big"}):
        assert httpx.patch(url, json=body, timeout=10).status_code == 422, body
    refused = httpx.patch(f"{server.url}/admin/models/plain/cache", json={"ttl_s": 5}, timeout=10)
    assert refused.status_code == 409
    restored = httpx.patch(url, json={"max_bytes": None, "ttl_s": None}, timeout=10)  # null: model.yaml's
    assert restored.status_code == 200
    assert (restored.json()["cache"]["max_bytes"], restored.json()["cache"]["ttl_s"]) == (CACHE["max_bytes"],
                                                                                          CACHE["ttl_s"])


def test_a_worker_killed_under_shared_requests_fails_only_the_one_it_held(server: ServerProcess) -> None:
    """The first request's error is its own: when the worker computing it dies, the identical
    requests waiting on it compute for themselves once the worker is back, and get their answer."""
    pid = httpx.get(server.url + "/healthz", timeout=10).json()["models"]["cached"]["instances"][0]["pid"]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            same = [asyncio.ensure_future(client.post("/v2/models/cached/infer", json=infer_body(11.5)))
                    for _ in range(6)]
            await asyncio.sleep(0.25)  # the first is computing (400 ms), the rest wait on it
            os.kill(pid, signal.SIGKILL)
            return list(await asyncio.gather(*same))

    answers = asyncio.run(scenario())
    ok = [a for a in answers if a.status_code == 200]
    lost = [a for a in answers if a.status_code != 200]
    assert all(a.json()["outputs"][0]["data"] == [11.5] for a in ok)
    assert len(lost) <= 1 and all(error_code(a) == "worker_lost" for a in lost), [a.text for a in lost]
    eventually(lambda: httpx.get(server.url + "/healthz", timeout=10).json()["models"]["cached"]["state"] == "ready",
               60, "the worker was not replaced")


def test_a_model_yaml_change_empties_the_cache_live(server: ServerProcess) -> None:
    assert post(server, "cached", 6.0).status_code == 200
    pids = [i["pid"] for i in httpx.get(server.url + "/healthz", timeout=10).json()["models"]["cached"]["instances"]]
    path: Path = server.root / "cached" / "model.yaml"  # type: ignore[attr-defined]
    doc = yaml.safe_load(path.read_text())
    doc["cache"] = {"max_bytes": 2 << 20, "ttl_s": 60}
    path.write_text(yaml.safe_dump(doc))
    eventually(lambda: cache_doc(server, "cached")["cache"]["max_bytes"] == 2 << 20, 30,
               "the cache change never applied")
    assert cache_doc(server, "cached")["cache"]["entries"] == 0
    health = httpx.get(server.url + "/healthz", timeout=10).json()["models"]["cached"]
    assert [i["pid"] for i in health["instances"]] == pids  # applied live: the same workers
    before = rows_computed(server, "cached")
    assert post(server, "cached", 6.0).status_code == 200
    assert rows_computed(server, "cached") == before + 1


def test_a_non_deterministic_model_is_refused_a_cache(server: ServerProcess) -> None:
    root: Path = server.root  # type: ignore[attr-defined]
    slow_model(root, "dice", 10, max_batch_size=1, deterministic=False, cache=CACHE)
    refused = httpx.post(f"{server.url}/v2/repository/models/dice/load", timeout=60)
    assert 400 <= refused.status_code < 500, refused.text
    assert "never cached" in refused.json()["error"]  # the OIP error body: {"error": "<message>"}
