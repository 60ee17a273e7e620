"""A lazy pool under churn: clients go round the models of a repository whose budget holds only
some of them, so nearly every request finds its model evicted, being evicted or loading. Each
must wait for its model's (re)load within its deadline, as the README promises, never get an
immediate 503 `model_loading` because it arrived while its model was being evicted (issue 45 W2:
6-8 a minute under a 40-model round-robin).

Each client goes round every model once per round, in its own (seeded) order: with the least
recently used model evicted to make room, a strict common order would never ask for the model
being evicted. The models' teardown takes 1 s, as a model that frees a large working set does: an
eviction lasts that long, and requests do arrive while it runs (before the fix, 8 of these 32
requests got 503 model_loading "being evicted to make room"; 3 to 13 of 48 in earlier runs).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import httpx

from pool_models import pool_body, pool_model
from servers import ServerFactory, ServerProcess
from servewell.config.model_file import read_model_yaml
from servewell.engine.memory_budget import estimate_model_memory

MODELS = [f"m{i}" for i in range(4)]
CLIENTS = 4
ROUNDS = 2


def metric_total(server: ServerProcess, family: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(family + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def answer_kind(response: httpx.Response) -> str:
    if response.status_code == 200:
        return "200"
    return f"{response.status_code} {response.json().get('code')}"


def test_round_robin_over_evicting_models_waits_for_every_reload_and_never_gets_model_loading(
        start_server: ServerFactory, tmp_path: Path) -> None:
    for name in MODELS:
        pool_model(tmp_path, name, teardown_ms=1000)
    one = estimate_model_memory(read_model_yaml(tmp_path / "m0"), tmp_path / "m0").total_bytes
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy",
                           "--memory-budget-bytes", str(2 * one + one // 2), "--max-load-wait-ms", "60000"])
    server.wait_ready()

    async def client(seed: int, rounds: int, http: httpx.AsyncClient) -> list[str]:
        order = random.Random(seed)
        kinds = []
        for _ in range(rounds):
            for name in order.sample(MODELS, len(MODELS)):
                kinds.append(answer_kind(await http.post(f"/v2/models/{name}/infer", json=pool_body())))
        return kinds

    async def run() -> Counter[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            results = await asyncio.gather(*(client(seed, ROUNDS, http) for seed in range(CLIENTS)))
        return Counter(kind for kinds in results for kind in kinds)

    kinds = asyncio.run(run())
    evictions = metric_total(server, "servewell_model_evictions_total", reason="memory")
    assert evictions >= len(MODELS), (evictions, kinds)  # the churn happened: models were evicted and reloaded
    assert kinds == Counter({"200": CLIENTS * ROUNDS * len(MODELS)}), kinds
