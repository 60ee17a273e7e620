"""Fair admission (issue 46) through a real split server: a tenant that floods a model fills its
lane, and a tenant within its share is still admitted (the flooder's newest request is pushed out
and answered 503 `overloaded`, its tenant named), over HTTP from both ingress processes; every
refusal is counted for its tenant in /metrics and /admin/tenants and named in the log.

`slow` echoes its input after 100 ms per batch, one row a batch, and queues at most 8 requests
per lane, so a burst of 30 fills the lane many times over."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from error_bodies import error_code
from model_dirs import infer_body, slow_model
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from waiting import eventually

KEYS = {name: f"{name}-secret-0123456789abcdef" for name in ("flood", "light")}
KEYS_FILE = "".join(f"{name}:{secret} tenant={name}\n" for name, secret in KEYS.items())
ADMIN = {"Authorization": "Bearer fair-admin-token-0123456789"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("fair-repo")
    slow_model(root, "slow", 100, max_batch_size=1, batching={"max_queue_size": 8})
    # 3 s a batch, 4 places: five requests fill it for seconds (a lane full without churn)
    slow_model(root, "stuck", 3000, max_batch_size=1, batching={"max_queue_size": 4, "policy": "idle"})
    keys_file = tmp_path_factory.mktemp("fair-keys") / "keys.txt"
    keys_file.write_text(KEYS_FILE)
    started = start_module_server(["--model-repository", str(root), "--ingress-processes", "2",
                                   "--api-keys-file", str(keys_file), "--admin-token", ADMIN["Authorization"][7:]])
    started.wait_ready()
    return started


async def one(server: ServerProcess, key: str, value: float) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        return await client.post("/v2/models/slow/infer", json=infer_body(value), headers={"X-API-Key": key})


async def flood_and_light(server: ServerProcess) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """30 flood requests at once; once the lane is full, 3 light requests (within light's half)."""
    flood = [asyncio.ensure_future(one(server, KEYS["flood"], 1.0)) for _ in range(30)]
    refused = 0
    while refused == 0:  # the lane is full once the flooder is being refused
        done, _ = await asyncio.wait(flood, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        refused = sum(1 for f in done if f.result().status_code == 503)
    light = await asyncio.gather(*(one(server, KEYS["light"], 2.0) for _ in range(3)))
    return list(await asyncio.gather(*flood)), list(light)


def test_a_tenant_within_its_share_is_admitted_while_another_floods_the_lane(server: ServerProcess) -> None:
    flood, light = asyncio.run(flood_and_light(server))
    assert [r.status_code for r in light] == [200, 200, 200], [r.text for r in light]
    refused = [r for r in flood if r.status_code == 503]
    assert refused and all(error_code(r) == "overloaded" for r in refused)
    assert all("tenant 'flood'" in r.json()["error"] for r in refused), refused[0].text
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)


def test_every_refusal_is_counted_for_its_tenant_and_named_in_the_log(server: ServerProcess) -> None:
    flood, light = asyncio.run(flood_and_light(server))
    refused = sum(1 for r in flood if r.status_code == 503)
    assert refused and all(r.status_code == 200 for r in light)

    def counted() -> bool:
        return scraped_total(server.url, "servewell_refusals_total", ADMIN, model="slow", tenant="flood",
                             reason="overloaded") >= refused
    eventually(counted, 10, "the flood's refusals counted for tenant flood")
    assert scraped_total(server.url, "servewell_refusals_total", ADMIN, tenant="light") == 0
    tenants = {t["tenant"]: t for t in httpx.get(server.url + "/admin/tenants", headers=ADMIN, timeout=10)
               .json()["tenants"]}
    assert tenants["flood"]["refused"] >= refused and tenants["light"]["refused"] == 0
    eventually(lambda: "tenant flood" in server.log(), 10, "a refusal log line naming tenant flood")


async def headers_only(server: ServerProcess, key: str, path: str = "/v2/models/slow/infer") -> bytes:
    """A request whose body never comes: only a refusal decided before reading it can answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode())
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), 2.0)
    except TimeoutError:
        return b""
    finally:
        writer.close()


def test_a_full_lane_refuses_its_holder_before_the_body_is_read(server: ServerProcess) -> None:
    async def fill() -> list[httpx.Response]:  # one runs, four wait: full for about 15 s
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return list(await asyncio.gather(*(
                client.post("/v2/models/stuck/infer", json=infer_body(1.0), headers={"X-API-Key": KEYS["flood"]})
                for _ in range(5))))

    async def main() -> tuple[bytes, bytes, bytes]:
        filling = asyncio.ensure_future(fill())
        await asyncio.sleep(1.0)  # the five are in (and the engine told the ingress processes)
        answer = await headers_only(server, KEYS["flood"], "/v2/models/stuck/infer")
        predict = await headers_only(server, KEYS["flood"], "/predict?model=stuck")  # the model named in the URL
        light = await headers_only(server, KEYS["light"], "/v2/models/stuck/infer")  # within its share
        assert all(r.status_code == 200 for r in await filling)
        return answer, predict, light

    answer, predict, light = asyncio.run(main())
    for refusal in (answer, predict):
        assert refusal.startswith(b"HTTP/1.1 503") and b"overloaded" in refusal and b"tenant 'flood'" in refusal, \
            refusal
    assert not light.startswith(b"HTTP/1.1 503"), light  # its body was waited for (408 once it did not come)


def test_places_promised_to_requests_still_being_read_fill_a_nearly_full_lane(server: ServerProcess) -> None:
    """Two of `stuck`'s four places are free, shared between the two ingress processes: of three
    requests whose bodies are still coming, at least one is refused before its body is read, as
    the free places are promised to the others (engine/promised.py)."""
    async def fill() -> list[httpx.Response]:  # one runs, two wait: two places free for about 9 s
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return list(await asyncio.gather(*(
                client.post("/v2/models/stuck/infer", json=infer_body(1.0), headers={"X-API-Key": KEYS["flood"]})
                for _ in range(3))))

    async def main() -> list[bytes]:
        filling = asyncio.ensure_future(fill())
        await asyncio.sleep(1.0)  # the three are in (and the engine told the ingress processes)
        answers, writers = [], []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writers.append(writer)
            writer.write((f"POST /v2/models/stuck/infer HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEYS['flood']}\r\n"
                          "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode())
            await writer.drain()
            try:
                answers.append(await asyncio.wait_for(reader.read(4096), 0.5))
            except TimeoutError:
                answers.append(b"")  # admitted: its place is promised while its body is awaited
        for writer in writers:
            writer.close()
        assert all(r.status_code == 200 for r in await filling)
        return answers

    answers = asyncio.run(main())
    refused = [a for a in answers if a]
    assert refused and len(refused) < 3, answers
    for answer in refused:
        assert answer.startswith(b"HTTP/1.1 503") and b"on their way in" in answer and b"tenant 'flood'" in answer, \
            answer
