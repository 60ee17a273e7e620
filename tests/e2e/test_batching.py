"""Scheduling seen from outside: urgent requests overtake, expired and abandoned requests never
reach the model (counted by the worker), a full queue refuses at once, settings change live."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from error_bodies import error_code, error_of
from model_dirs import infer_body as body
from model_dirs import slow_model
from waiting import eventually_async


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("slow-repo")
    slow_model(root, "slow", 100, max_batch_size=4)
    slow_model(root, "tiny_queue", 150, max_batch_size=1, batching={"max_queue_size": 2})
    # 600 ms a request: long enough that on a loaded 2-core machine the first request is surely
    # computing when the next arrives, and that an abandoned one is cancelled well before its turn.
    slow_model(root, "one_at_a_time", 600, max_batch_size=1)
    # Batches of exactly two (the window waits up to 5 s for the second); a stopped worker is not
    # declared hung by its batch's budget while the transit test holds it.
    slow_model(root, "pair", 10, max_batch_size=2,
               batching={"policy": "window", "max_wait_ms": 5000, "compute_timeout_ms": 20000})
    srv = start_module_server(["--model-repository", str(root)])
    srv.wait_ready()
    return srv


def rows_computed(url: str, model: str) -> int:
    health = httpx.get(url + "/healthz").json()
    return sum(i["rows_computed"] for i in health["models"][model]["instances"])


def test_urgent_request_overtakes_a_full_normal_queue(server):
    async def main():
        order: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            async def send(tag: str, value: float, **params):
                r = await c.post("/v2/models/slow/infer", json=body(value, **params))
                assert r.status_code == 200, r.text
                assert r.json()["outputs"][0]["data"] == [value]  # every request gets its own row back
                order.append(tag)

            normal = [asyncio.create_task(send(f"n{i}", i)) for i in range(24)]

            async def queue_filled() -> bool:
                return (await c.get("/healthz")).json()["models"]["slow"]["queue_depth"] >= 12

            await eventually_async(queue_filled, 30, "12 normal requests never queued")
            urgent = asyncio.create_task(send("urgent", 99.0, priority=1))
            await asyncio.gather(urgent, *normal)
        # 24 normal requests make 6 batches of 4; the urgent one waits only for the running batch.
        assert order.index("urgent") <= 8, order
    asyncio.run(main())


def test_expired_requests_are_answered_503_and_never_reach_the_model(server):
    before = rows_computed(server.url, "one_at_a_time")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v2/models/one_at_a_time/infer", json=body(1)))
            await asyncio.sleep(0.05)
            doomed = [c.post("/v2/models/one_at_a_time/infer", json=body(2), headers={"X-Request-Timeout-Ms": "30"})
                      for _ in range(3)]
            doomed.append(c.post("/v2/models/one_at_a_time/infer", json=body(3, timeout=30_000)))  # OIP: microseconds
            answers = await asyncio.gather(*doomed)
            assert (await first).status_code == 200
            return answers

    answers = asyncio.run(main())
    for r in answers:
        assert r.status_code == 503 and error_code(r) == "deadline_exceeded"
        assert "retry-after" in r.headers
    assert rows_computed(server.url, "one_at_a_time") - before == 1  # only the first request ran
    assert httpx.get(server.url + "/healthz").json()["models"]["one_at_a_time"]["scheduler"]["expired"] >= 4


def test_abandoned_request_is_dropped_before_compute(server):
    before = rows_computed(server.url, "one_at_a_time")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v2/models/one_at_a_time/infer", json=body(1)))
            await asyncio.sleep(0.2)  # the first is computing (600 ms)
            async with httpx.AsyncClient(base_url=server.url, timeout=0.05) as impatient:
                with pytest.raises(httpx.TimeoutException):
                    await impatient.post("/v2/models/one_at_a_time/infer", json=body(2))
            assert (await first).status_code == 200
            await asyncio.sleep(0.9)  # the abandoned request would have run (600 ms) by now

    asyncio.run(main())
    assert rows_computed(server.url, "one_at_a_time") - before == 1
    assert httpx.get(server.url + "/healthz").json()["models"]["one_at_a_time"]["scheduler"]["cancelled"] >= 1


def test_a_request_whose_deadline_passes_in_transit_is_skipped_by_the_worker(server):
    """A batch of two is handed to a worker that cannot read it yet (stopped, well under its
    heartbeat timeout); one request's deadline passes meanwhile. The worker computes only the
    other's row (its rows_computed counter says so) and that request gets its own answer."""
    before = rows_computed(server.url, "pair")
    worker = httpx.get(server.url + "/healthz").json()["models"]["pair"]["instances"][0]["pid"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            os.kill(worker, signal.SIGSTOP)
            try:
                patient = asyncio.create_task(c.post("/v2/models/pair/infer", json=body(7)))
                await asyncio.sleep(0.1)  # queued first, waiting for a batch-mate
                doomed = await c.post("/v2/models/pair/infer", json=body(8), headers={"X-Request-Timeout-Ms": "400"})
            finally:
                os.kill(worker, signal.SIGCONT)
            return await patient, doomed

    patient, doomed = asyncio.run(main())
    assert doomed.status_code == 503 and error_code(doomed) == "deadline_exceeded"
    assert "while its batch was running" in error_of(doomed)["message"]  # it was in the batch sent, not queued
    assert patient.status_code == 200 and patient.json()["outputs"][0]["data"] == [7.0]
    assert rows_computed(server.url, "pair") - before == 1  # the doomed row never reached the model
    health = httpx.get(server.url + "/healthz").json()["models"]["pair"]
    assert health["scheduler"]["expired"] >= 1 and health["instances"][0]["pid"] == worker  # not replaced


def test_full_queue_refuses_at_once_with_retry_after_and_never_500(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(c.post("/v2/models/tiny_queue/infer", json=body(i)) for i in range(16)))

    answers = asyncio.run(main())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 503}, codes
    refused = [r for r in answers if r.status_code == 503]
    assert refused and codes.count(200) >= 3
    for r in refused:
        assert error_code(r) == "overloaded" and int(r.headers["retry-after"]) >= 1


def test_batching_settings_change_while_serving(server):
    url = server.url + "/admin/models/slow/batching"
    assert httpx.get(url).json()["policy"] == "idle"
    changed = httpx.patch(url, json={"policy": "window", "max_wait_ms": 5, "max_batch_size": 2})
    assert changed.status_code == 200 and changed.json()["policy"] == "window"
    assert httpx.get(url).json()["max_batch_size"] == 2
    bad = httpx.patch(url, json={"max_batch_size": 99})
    assert bad.status_code == 422 and error_code(bad) == "invalid_input"
    r = httpx.post(server.url + "/v2/models/slow/infer", json=body(5))
    assert r.status_code == 200
    httpx.patch(url, json={"policy": "idle", "max_batch_size": 4})


def test_a_batching_patch_with_one_invalid_field_changes_nothing(server):
    url = server.url + "/admin/models/slow/batching"
    before = httpx.get(url).json()
    bad = httpx.patch(url, json={"max_batch_size": 1, "policy": "window", "max_wait_ms": -1})
    assert bad.status_code == 422 and error_code(bad) == "invalid_input"
    assert httpx.get(url).json() == before  # neither the valid size nor the valid policy applied


#: PATCH values that stopped a model (issue 19.10), and the bound each 422 names.
MODEL_STOPPERS = [
    ({"compute_timeout_ms": 0.001}, "compute_timeout_ms", "greater than or equal to 100"),
    ({"policy": "window", "max_wait_ms": 1e308}, "max_wait_ms", "less than or equal to 10000"),
    ({"default_timeout_ms": 1e300}, "default_timeout_ms", "less than or equal to 600000"),
    ({"max_queue_size": 10**12}, "max_queue_size", "less than or equal to 100000"),
]


@pytest.mark.parametrize(("patch", "field", "bound"), MODEL_STOPPERS)
def test_batching_values_that_would_stop_the_model_get_422_and_it_keeps_serving(server, patch, field, bound):
    url = server.url + "/admin/models/slow/batching"
    before = httpx.get(url).json()
    bad = httpx.patch(url, json=patch)
    assert bad.status_code == 422, bad.text
    error = bad.json()["error"]
    assert error["code"] == "invalid_input" and field in error["message"] and bound in error["message"], error
    assert httpx.get(url).json() == before
    r = httpx.post(server.url + "/v2/models/slow/infer", json=body(3), timeout=30)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0]


def test_a_compute_timeout_below_the_measured_batch_latency_does_not_declare_batches_hung(server):
    # `slow` takes 100 ms a batch: a 100 ms budget taken literally declares every batch hung.
    url = server.url + "/admin/models/slow/batching"
    restarts = httpx.get(server.url + "/healthz").json()["models"]["slow"]["restarts"]
    assert httpx.patch(url, json={"compute_timeout_ms": 100}).status_code == 200
    try:
        for value in range(4):
            r = httpx.post(server.url + "/v2/models/slow/infer", json=body(value), timeout=30)
            assert r.status_code == 200, r.text
    finally:
        httpx.patch(url, json={"compute_timeout_ms": None})
    assert httpx.get(server.url + "/healthz").json()["models"]["slow"]["restarts"] == restarts


def test_null_returns_a_batching_setting_to_the_model_yaml_value(server):
    url = server.url + "/admin/models/slow/batching"
    changed = httpx.patch(url, json={"policy": "window", "max_wait_ms": 7, "compute_timeout_ms": 5000})
    assert changed.status_code == 200, changed.text
    overrides = httpx.get(server.url + "/admin/config").json()["models"]["slow"]["overrides"]
    assert overrides.items() >= {"policy": "window", "max_wait_ms": 7, "compute_timeout_ms": 5000}.items()
    reset = httpx.patch(url, json={"policy": None, "max_wait_ms": None, "compute_timeout_ms": None})
    assert reset.status_code == 200, reset.text
    # slow's model.yaml sets no batching: the built-in defaults, and no override left.
    assert {k: reset.json()[k] for k in ("policy", "max_wait_ms", "compute_timeout_ms")} == {
        "policy": "idle", "max_wait_ms": 25.0, "compute_timeout_ms": None}
    overrides = httpx.get(server.url + "/admin/config").json()["models"]["slow"]["overrides"]
    assert not {"policy", "max_wait_ms", "compute_timeout_ms"} & set(overrides), overrides
    assert httpx.post(server.url + "/v2/models/slow/infer", json=body(2), timeout=30).status_code == 200


def test_a_loopback_request_that_came_through_a_proxy_is_not_admin(server):
    # This server has no admin token: loopback clients are admin, unless a proxy forwarded them
    # (a proxy on this host connects from 127.0.0.1 for anyone; issue 19.5).
    url = server.url + "/admin/models/slow/batching"
    assert httpx.get(url).status_code == 200
    for header in ({"X-Forwarded-For": "127.0.0.1"}, {"Forwarded": "for=127.0.0.1"}, {"Via": "1.1 haproxy"}):
        refused = httpx.patch(url, json={"max_wait_ms": 5}, headers=header)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden", refused.text
        state = httpx.get(server.url + "/console/api/state", headers=header).json()
        assert state["server"]["admin"] is False and state["recent"] is None, header
    assert httpx.get(server.url + "/console/api/state").json()["server"]["admin"] is True
