"""Fair admission (issue 46) through a real split server: a tenant that floods a model fills its
lane, and a tenant within its share is still admitted (the flooder's newest request is pushed out
and answered 503 `overloaded`, its tenant named), over HTTP from both ingress processes.

`slow` echoes its input after 100 ms per batch, one row a batch, and queues at most 8 requests
per lane, so a burst of 30 fills the lane many times over."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from error_bodies import error_code
from model_dirs import infer_body, slow_model
from servers import ServerFactory, ServerProcess

KEYS = {name: f"{name}-secret-0123456789abcdef" for name in ("flood", "light")}
KEYS_FILE = "".join(f"{name}:{secret} tenant={name}\n" for name, secret in KEYS.items())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("fair-repo")
    slow_model(root, "slow", 100, max_batch_size=1, batching={"max_queue_size": 8})
    keys_file = tmp_path_factory.mktemp("fair-keys") / "keys.txt"
    keys_file.write_text(KEYS_FILE)
    started = start_module_server(["--model-repository", str(root), "--ingress-processes", "2",
                                   "--api-keys-file", str(keys_file)])
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
