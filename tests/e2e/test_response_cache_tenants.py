"""The response cache with tenants (issue 45, H3 and H4) through a real server with a keys file:
one tenant's answers and computations are never another's (a hit would tell tenant b that tenant a
sent these inputs), unless the model's cache says `shared_across_tenants`; and when the request a
computation started for leaves (its client disconnects), the identical requests waiting for it
still get that computation's answer instead of computing again, each.

`private` and `public` are python models that double their input after 200 ms per batch; `slow`
after 1.5 s; all take one row a batch, so every computation is a batch and shows in the workers'
`rows_computed`.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from servers import ServerFactory, ServerProcess
from waiting import eventually

ADMIN = "cache-tenants-admin-token-0123456789"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
KEYS = {name: f"{name}-cache-secret-0123456789abcdef" for name in ("alpha", "bravo")}
A = {"X-API-Key": KEYS["alpha"]}
B = {"X-API-Key": KEYS["bravo"]}
CACHE = {"max_bytes": 1 << 20, "ttl_s": 600}
SLOW_MS = 1500

DOUBLER = textwrap.dedent('''
    import time


    class Doubler:
        """y = 2 x, after `execute_ms` per batch."""

        def setup(self, config):
            self.execute_s = config["settings"]["execute_ms"] / 1000.0

        def execute(self, inputs):
            time.sleep(self.execute_s)
            return {"y": inputs["x"] * 2.0}
''')


def pool_model(root: Path, name: str, execute_ms: int, **fields: Any) -> None:
    """The python model `name`: x [2] -> y [2] = 2 x after `execute_ms` per batch, one row a batch."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "doubler.py").write_text(DOUBLER)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "doubler.py",
        "python": {"entry": "doubler:Doubler", "settings": {"execute_ms": execute_ms}},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}], "max_batch_size": 1, **fields,
    }))


def pool_body(value: float) -> dict[str, Any]:
    """One row [value, value]."""
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [value, value]}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("cache-tenants-repo")
    pool_model(root, "private", 200, cache=CACHE)
    pool_model(root, "public", 200, cache={**CACHE, "shared_across_tenants": True})
    pool_model(root, "slow", SLOW_MS, cache=CACHE)
    keys_file = tmp_path_factory.mktemp("cache-tenant-keys") / "keys.txt"
    keys_file.write_text(f"alpha:{KEYS['alpha']} tenant=a\nbravo:{KEYS['bravo']} tenant=b\n")
    started = start_module_server(["--model-repository", str(root), "--api-keys-file", str(keys_file),
                                   "--admin-token", ADMIN])
    started.wait_ready()
    return started


def rows_computed(server: ServerProcess, model: str) -> int:
    health = httpx.get(server.url + "/healthz", headers=ADMIN_AUTH, timeout=10).json()
    return int(sum(i["rows_computed"] for i in health["models"][model]["instances"]))


def cancelled(server: ServerProcess, model: str) -> float:
    """Requests of `model` whose client left before their answer (metrics are an operator's with keys)."""
    text = httpx.get(server.url + "/metrics", headers=ADMIN_AUTH, timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "servewell_requests_total" and sample.labels.get("model") == model
               and sample.labels.get("outcome") == "cancelled")


def post(server: ServerProcess, model: str, value: float, key: dict[str, str]) -> httpx.Response:
    answer = httpx.post(f"{server.url}/v2/models/{model}/infer", json=pool_body(value), headers=key, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def cache_said(answer: httpx.Response) -> str | None:
    """What `Server-Timing` says of the cache: hit, coalesced, or miss (computed for this request)."""
    for part in answer.headers["server-timing"].split(","):
        name, _, desc = part.strip().partition(";desc=")
        if name == "cache":
            return desc
    return None


def test_a_tenant_is_never_answered_from_another_tenants_request(server: ServerProcess) -> None:
    before = rows_computed(server, "private")
    assert cache_said(post(server, "private", 4.5, A)) == "miss"
    assert cache_said(post(server, "private", 4.5, A)) == "hit"  # the cache works for tenant a itself
    probe = post(server, "private", 4.5, B)
    assert cache_said(probe) == "miss"  # tenant b learns nothing of what tenant a sent
    assert probe.json()["outputs"][0]["data"] == [9.0, 9.0]
    assert rows_computed(server, "private") == before + 2
    assert cache_said(post(server, "private", 4.5, B)) == "hit"  # and b's own repeat is its hit


def test_tenants_do_not_share_a_computation_in_flight(server: ServerProcess) -> None:
    before = rows_computed(server, "private")

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = asyncio.ensure_future(client.post("/v2/models/private/infer", json=pool_body(6.5), headers=A))
            await asyncio.sleep(0.05)  # a's computation is queued or running (200 ms)
            second = client.post("/v2/models/private/infer", json=pool_body(6.5), headers=B)
            return list(await asyncio.gather(first, second))

    answers = asyncio.run(both())
    assert [a.status_code for a in answers] == [200, 200]
    assert [cache_said(a) for a in answers] == ["miss", "miss"]
    assert rows_computed(server, "private") == before + 2


def test_a_model_shared_across_tenants_answers_every_tenant_from_one_cache(server: ServerProcess) -> None:
    before = rows_computed(server, "public")
    assert cache_said(post(server, "public", 2.5, A)) == "miss"
    assert cache_said(post(server, "public", 2.5, B)) == "hit"  # the documented consequence of sharing
    assert rows_computed(server, "public") == before + 1
    doc = httpx.get(f"{server.url}/admin/models/public/cache", headers=ADMIN_AUTH, timeout=10).json()
    assert doc["cache"]["shared_across_tenants"] is True


def test_when_the_first_request_leaves_the_others_get_its_computation(server: ServerProcess) -> None:
    before = rows_computed(server, "slow")
    left = cancelled(server, "slow")

    async def scenario() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            leader = asyncio.ensure_future(client.post("/v2/models/slow/infer", json=pool_body(9.5), headers=A))
            await asyncio.sleep(0.15)  # the leader's computation runs (1.5 s)
            started = time.monotonic()
            followers = [asyncio.ensure_future(client.post("/v2/models/slow/infer", json=pool_body(9.5),
                                                           headers=A)) for _ in range(5)]
            await asyncio.sleep(0.3)
            leader.cancel()  # its client disconnects; the five wait for the same answer
            answers = list(await asyncio.gather(*followers))
            return answers, time.monotonic() - started

    answers, elapsed_s = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200] * 5
    assert all(a.json()["outputs"][0]["data"] == [19.0, 19.0] for a in answers)
    assert all(cache_said(a) == "coalesced" for a in answers), [a.headers["server-timing"] for a in answers]
    # The server saw the leader leave before the answer (so the five did wait without it) ...
    eventually(lambda: cancelled(server, "slow") == left + 1, 10, "the leader's leaving was not seen")
    # ... and one computation answered all of them: none computed again after it left.
    assert rows_computed(server, "slow") == before + 1
    assert elapsed_s < 2 * SLOW_MS / 1000, elapsed_s  # the leader's computation, not another one after it
