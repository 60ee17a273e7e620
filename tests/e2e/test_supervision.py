"""Worker death under load and SIGTERM under load: nothing hangs, nothing 500s, nothing is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from test_batching import body, slow_model  # the same stand-in model


@pytest.fixture()
def server(tmp_path, start_server):
    slow_model(tmp_path, "slow", 30, max_batch_size=4, instances=2)
    srv = start_server(["--model-repository", str(tmp_path)])
    srv.wait_ready()
    return srv


async def _load(url: str, seconds: float, concurrency: int = 8) -> list[httpx.Response | Exception]:
    answers: list[httpx.Response | Exception] = []
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def user(i: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    answers.append(await client.post("/v2/models/slow/infer", json=body(float(i))))
                except httpx.HTTPError as exc:
                    answers.append(exc)
        await asyncio.gather(*(user(i) for i in range(concurrency)))
    return answers


def worker_pids(url: str) -> list[int]:
    return [i["pid"] for i in httpx.get(url + "/healthz").json()["models"]["slow"]["instances"]]


def test_kill_9_of_a_worker_under_load_gives_only_200_and_503_and_recovers(server):
    victim = worker_pids(server.url)[0]

    async def main():
        load = asyncio.create_task(_load(server.url, 4.0))
        await asyncio.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        return await load

    answers = asyncio.run(main())
    assert all(isinstance(a, httpx.Response) for a in answers), [a for a in answers if not isinstance(a, httpx.Response)]
    codes = {a.status_code for a in answers}
    assert codes <= {200, 503}, codes
    lost = [a for a in answers if a.status_code == 503]
    assert all(a.json()["error"]["code"] in ("worker_lost", "model_not_ready") for a in lost)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/healthz").json()["models"]["slow"]
        if health["state"] == "ready" and victim not in worker_pids(server.url):
            break
        time.sleep(0.2)
    assert health["state"] == "ready" and all(i["alive"] for i in health["instances"])
    assert httpx.post(server.url + "/v2/models/slow/infer", json=body(1.0)).status_code == 200


def test_sigterm_under_load_finishes_every_accepted_request(server):
    async def main():
        load = asyncio.create_task(_load(server.url, 3.0, concurrency=12))
        await asyncio.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        return await load

    answers = asyncio.run(main())
    responses = [a for a in answers if isinstance(a, httpx.Response)]
    # Accepted requests all complete with 200. After the signal, new connections are refused and
    # idle keep-alive connections are closed under the client's feet: a transport error on a
    # request the server never read, never a 5xx and never a hang (timeout).
    assert responses and {r.status_code for r in responses} == {200}
    refused = [a for a in answers if not isinstance(a, httpx.Response)]
    assert all(isinstance(a, httpx.TransportError) and not isinstance(a, httpx.TimeoutException) for a in refused), refused
    # uvicorn re-raises the signal after its graceful shutdown, so the exit status is -SIGTERM.
    assert server.proc.wait(30) in (0, -signal.SIGTERM)
    assert "Finished server process" in server.log()
