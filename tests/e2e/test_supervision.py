"""Worker death under load and SIGTERM under load: nothing hangs, nothing 500s, nothing is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from error_bodies import error_code
from model_dirs import factory_model, slow_model
from model_dirs import infer_body as body
from waiting import eventually


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


def worker_pids(url: str, model: str = "slow") -> list[int]:
    return [i["pid"] for i in httpx.get(url + "/healthz").json()["models"][model]["instances"]]


def test_kill_9_of_a_worker_under_load_gives_only_200_and_503_and_recovers(server):
    victim = worker_pids(server.url)[0]

    async def main():
        load = asyncio.create_task(_load(server.url, 4.0))
        await asyncio.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        return await load

    answers = asyncio.run(main())
    failures = [a for a in answers if not isinstance(a, httpx.Response)]
    assert not failures, failures
    codes = {a.status_code for a in answers}
    assert codes <= {200, 503}, codes
    lost = [a for a in answers if a.status_code == 503]
    assert all(error_code(a) in ("worker_lost", "model_not_ready") for a in lost)

    def replaced() -> dict | None:
        health = server.health()["models"]["slow"]
        return health if health["state"] == "ready" and victim not in worker_pids(server.url) else None

    health = eventually(replaced, 60, "the killed worker was not replaced")
    assert all(i["alive"] for i in health["instances"]), health
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
    assert all(isinstance(a, httpx.TransportError) and not isinstance(a, httpx.TimeoutException)
               for a in refused), refused
    # uvicorn re-raises the signal after its graceful shutdown, so the exit status is -SIGTERM.
    assert server.proc.wait(30) in (0, -signal.SIGTERM)
    assert "Finished server process" in server.log()


FAULTY = '''
import torch
from torch import nn


class Faulty(nn.Module):
    """Fault injection for the GPU paths on a CPU: out of memory above 2 rows, a device-side
    assert on the value 13."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        if bool((x == 13).any()):
            raise RuntimeError("CUDA error: device-side assert triggered")
        if x.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x * self.scale


def build():
    return Faulty()
'''


def test_device_faults_split_batches_and_restart_the_worker(tmp_path, start_server):
    factory_model(tmp_path, "faulty", FAULTY, max_batch_size=8, warmup=False)
    server = start_server(["--model-repository", str(tmp_path)])
    server.wait_ready()
    rows = {"inputs": [{"name": "x", "shape": [6, 1], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]}
    r = httpx.post(server.url + "/v2/models/faulty/infer", json=rows)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1, 2, 3, 4, 5, 6]  # split in pieces of 2
    assert httpx.get(server.url + "/admin/models/faulty/batching").json()["max_batch_size"] == 2
    before = worker_pids(server.url, "faulty")
    r = httpx.post(server.url + "/v2/models/faulty/infer", json=body(13.0))
    assert r.status_code == 503 and error_code(r) == "worker_lost"

    def restarted() -> dict | None:
        model = server.health()["models"]["faulty"]
        return model if model["state"] == "ready" and model["restarts"] >= 1 \
            and worker_pids(server.url, "faulty") != before else None

    model = eventually(restarted, 60, "the worker was not restarted after the device error")
    assert model["restarts"] == 1, model
    assert httpx.post(server.url + "/v2/models/faulty/infer", json=body(1.0)).status_code == 200

