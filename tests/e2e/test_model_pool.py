"""Many models in one memory budget (`--repository-mode lazy`): load on first request, evict the
least recently used idle model to make room, never a pinned one, refuse what cannot fit.

One module server serves four tiny ONNX models, `pinned` (pinned: true) and `a`, `b`, `c`, in a
budget that holds three of them: `pinned` plus two others. Requests go through the split
(supervisor, engine, one ingress) as in production.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_dirs import onnx_mlp_model
from servers import ServerFactory, ServerProcess
from servewell.config.model_file import read_model_yaml
from servewell.engine.memory_budget import estimate_model_memory
from waiting import eventually

ROW = [1.0, 2.0, 3.0, 4.0]


def body(rows: int = 1) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": ROW * rows}]}


def infer(server: ServerProcess, model: str, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body(), timeout=timeout_s)


def models(server: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = server.health()["models"]
    return doc


def counter(server: ServerProcess, family: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(family + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def write_pool(root: Path) -> int:
    """Four models; returns a budget that holds three of them (not four)."""
    onnx_mlp_model(root, "pinned", pinned=True)
    for name in ("a", "b", "c"):
        onnx_mlp_model(root, name)
    one = estimate_model_memory(read_model_yaml(root / "a"), root / "a").total_bytes
    return 3 * one + one // 2


@pytest.fixture(scope="module")
def pool_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pool")


@pytest.fixture(scope="module")
def pool(pool_root: Path, start_module_server: ServerFactory) -> ServerProcess:
    root = pool_root
    budget = write_pool(root)
    server = start_module_server(["--model-repository", str(root), "--repository-mode", "lazy",
                                  "--memory-budget-bytes", str(budget), "--repository-poll-s", "0.5"])
    server.wait_ready()
    return server


def test_lazy_server_lists_every_model_and_loads_only_the_pinned_one_at_start(pool: ServerProcess) -> None:
    listed = models(pool)
    assert set(listed) >= {"pinned", "a", "b", "c"}
    assert listed["pinned"]["residency"] == "resident"
    assert listed["pinned"]["pinned"] is True
    for name in ("a", "b", "c"):
        if listed[name]["residency"] == "not_loaded":  # another test may have loaded it first
            assert listed[name]["loadable"] is True
        assert listed[name]["estimated_bytes"] > 0
    ready = httpx.get(f"{pool.url}/v2/health/ready", timeout=5)
    assert ready.status_code == 200


def test_first_request_loads_the_model_and_answers(pool: ServerProcess) -> None:
    response = infer(pool, "a")
    assert response.status_code == 200, response.text
    assert len(response.json()["outputs"][0]["data"]) == 3
    assert models(pool)["a"]["residency"] == "resident"
    start = models(pool)["a"]["last_start"]
    assert start["total_s"] > 0 and {"spawn_s", "import_s", "load_s", "warmup_s", "spare"} <= set(start)
    assert counter(pool, "servewell_model_cold_start_seconds_count", model="a") >= 1
    misses = counter(pool, "servewell_model_pool_requests_total", result="miss")
    hits = counter(pool, "servewell_model_pool_requests_total", result="hit")
    assert misses >= 1
    assert infer(pool, "a").status_code == 200
    assert counter(pool, "servewell_model_pool_requests_total", result="hit") == hits + 1
    assert counter(pool, "servewell_model_pool_requests_total", result="miss") == misses


def test_a_load_past_the_budget_evicts_the_least_recently_used_idle_model_never_the_pinned_one(
        pool: ServerProcess) -> None:
    for name in ("a", "b"):  # a, then b: a is the least recently used of the two
        assert infer(pool, name).status_code == 200
    assert infer(pool, "pinned").status_code == 200
    before = counter(pool, "servewell_model_evictions_total", model="a", reason="memory")
    assert infer(pool, "c").status_code == 200
    listed = models(pool)
    assert listed["c"]["residency"] == "resident"
    assert listed["a"]["residency"] == "evicted", listed["a"]
    assert listed["b"]["residency"] == "resident"
    assert listed["pinned"]["residency"] == "resident"
    assert counter(pool, "servewell_model_evictions_total", model="a", reason="memory") == before + 1
    assert counter(pool, "servewell_model_evictions_total", model="pinned") == 0
    evictions = [json.loads(line) for line in pool.log().splitlines() if '"model_evicted"' in line]
    assert any(e.get("model") == "a" and e.get("reason") == "memory" for e in evictions)


def test_models_evicted_and_reloaded_under_load_answer_every_request(pool: ServerProcess) -> None:
    """Clients cycle through a, b and c (room for two) while others hit the pinned model: models are
    evicted and loaded again all the time, and every request is answered 200."""

    async def cycle(client: httpx.AsyncClient, names: list[str], rounds: int) -> list[int]:
        statuses = []
        for i in range(rounds):
            name = names[i % len(names)]
            response = await client.post(f"/v2/models/{name}/infer", json=body())
            statuses.append(response.status_code)
        return statuses

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=pool.url, timeout=120) as client:
            results = await asyncio.gather(
                cycle(client, ["a", "b", "c"], 9), cycle(client, ["c", "a", "b"], 9),
                cycle(client, ["pinned"], 60), cycle(client, ["pinned"], 60))
        return [status for statuses in results for status in statuses]

    before = counter(pool, "servewell_model_evictions_total", reason="memory")
    statuses = asyncio.run(run())
    assert statuses == [200] * len(statuses), sorted(set(statuses))
    assert counter(pool, "servewell_model_evictions_total", reason="memory") >= before + 2
    assert counter(pool, "servewell_model_evictions_total", model="pinned") == 0
    assert models(pool)["pinned"]["residency"] == "resident"


def test_a_new_model_directory_is_picked_up_by_the_poll(pool: ServerProcess, pool_root: Path) -> None:
    onnx_mlp_model(pool_root, "late")
    eventually(lambda: "late" in models(pool), 20, "the poll did not find the new model")
    assert models(pool)["late"]["residency"] == "not_loaded"
    assert infer(pool, "late").status_code == 200


def test_a_model_that_cannot_fit_even_after_eviction_is_refused_with_the_numbers(
        start_server: ServerFactory, tmp_path: Path) -> None:
    budget = write_pool(tmp_path)
    big = onnx_mlp_model(tmp_path, "big", instances=3)  # three: more than the pinned model leaves, not the budget
    assert budget - estimate_model_memory(read_model_yaml(tmp_path / "pinned"), tmp_path / "pinned").total_bytes \
        < estimate_model_memory(read_model_yaml(big), big).total_bytes <= budget
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy",
                           "--memory-budget-bytes", str(budget)])
    server.wait_ready()
    response = infer(server, "big")
    assert response.status_code == 503, response.text
    doc = response.json()
    assert "MiB" in doc["error"] and "memory budget" in doc["error"] and "pinned" in doc["error"], doc
    assert models(server)["pinned"]["residency"] == "resident"
    assert infer(server, "a").status_code == 200  # the refusal left everyone else serving


@pytest.fixture(scope="module")
def single_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("single-cache")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory,
           single_cache: Path) -> ServerProcess:
    """One process (--ingress-processes 0), no wait queue, idle models unloaded after a second."""
    root = tmp_path_factory.mktemp("single")
    budget = write_pool(root)
    server = start_module_server(["--model-repository", str(root), "--repository-mode", "lazy",
                                  "--cache-dir", str(single_cache),
                                  "--memory-budget-bytes", str(budget), "--load-queue-per-model", "0",
                                  "--idle-unload-s", "1", "--ingress-processes", "0"])
    server.wait_ready()
    return server


def test_past_the_wait_queue_a_request_gets_model_loading_and_its_load_still_starts(single: ServerProcess) -> None:
    response = infer(single, "b")
    assert response.status_code == 503, response.text
    assert response.json()["code"] == "model_loading"
    assert int(response.headers["Retry-After"]) >= 1
    eventually(lambda: models(single)["b"]["residency"] == "resident", 60, "the refused request's load did not run")
    assert infer(single, "b").status_code == 200


def test_an_idle_model_is_unloaded_after_idle_unload_s_but_not_a_pinned_one(single: ServerProcess) -> None:
    if models(single)["c"]["residency"] != "resident":
        infer(single, "c")  # starts the load (no wait queue)
        eventually(lambda: models(single)["c"]["residency"] == "resident", 60, "c did not load")
    eventually(lambda: models(single)["c"]["residency"] == "evicted", 15, "c was not unloaded when idle")
    assert counter(single, "servewell_model_evictions_total", model="c", reason="idle") >= 1
    assert models(single)["pinned"]["residency"] == "resident"
    assert counter(single, "servewell_model_evictions_total", model="pinned") == 0


def test_grpc_says_a_loadable_model_is_ready_and_its_first_inference_loads_it(pool: ServerProcess,
                                                                               pool_root: Path) -> None:
    import numpy as np
    import tritonclient.grpc as triton_grpc

    onnx_mlp_model(pool_root, "grpc_lazy")
    eventually(lambda: "grpc_lazy" in models(pool), 20, "the poll did not find the new model")
    client = triton_grpc.InferenceServerClient(pool.grpc_url)
    # The poll may have listed the directory while model.yaml was still being written (an invalid
    # model, not loadable), and reads it again at its next round.
    eventually(lambda: client.is_model_ready("grpc_lazy"), 10, "gRPC never said the loadable model is ready")
    assert models(pool)["grpc_lazy"]["residency"] == "not_loaded"
    x = triton_grpc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.array([ROW], dtype=np.float32))
    result = client.infer("grpc_lazy", [x], client_timeout=60)
    assert result.as_numpy("y").shape == (1, 3)
    assert models(pool)["grpc_lazy"]["residency"] == "resident"


def test_pinning_in_model_yaml_applies_live_without_a_reload(pool: ServerProcess, pool_root: Path) -> None:
    if "late" not in models(pool):
        onnx_mlp_model(pool_root, "late")
        eventually(lambda: "late" in models(pool), 20, "the poll did not find the new model")
    assert infer(pool, "late").status_code == 200
    before = models(pool)["late"]
    assert before["residency"] == "resident" and before["pinned"] is False
    path = pool_root / "late" / "model.yaml"
    path.write_text(path.read_text() + "pinned: true\n")
    eventually(lambda: models(pool)["late"]["pinned"], 20, "the pin in model.yaml was not applied")
    after = models(pool)["late"]
    assert after["residency"] == "resident"
    assert after["cold_starts"] == before["cold_starts"] and after["load_s"] == before["load_s"]  # no reload


def test_an_evicted_model_keeps_its_snapshot_and_its_reload_links_the_same_files(single: ServerProcess,
                                                                                 single_cache: Path) -> None:
    def snapshots() -> dict[Path, int]:
        return {p.parent: p.stat().st_ino for p in (single_cache / "snapshots").glob("*-a-1-*/model.onnx")}

    def load_a() -> None:
        infer(single, "a")  # no wait queue: refused, and the load starts
        eventually(lambda: models(single)["a"]["residency"] == "resident", 60, "a did not load")

    load_a()
    first = snapshots()
    assert len(first) == 1
    eventually(lambda: models(single)["a"]["residency"] == "evicted", 15, "a was not unloaded when idle")
    assert snapshots() == first  # kept while evicted
    load_a()
    # The parked snapshot is removed after the reload, on the store's lowered-priority threads: on a
    # busy machine a moment after the model is resident.
    eventually(lambda: len(snapshots()) == 1, 30, "the parked snapshot was not removed after the reload")
    second = snapshots()
    assert len(second) == 1 and set(second) != set(first)  # a new snapshot, the parked one removed
    assert list(second.values()) == list(first.values())  # the same inode: linked, not copied


def test_a_model_directory_caught_half_copied_by_the_poll_serves_once_complete(pool: ServerProcess, pool_root: Path,
                                                                               tmp_path: Path) -> None:
    # What `cp -r` into the repository looks like to a poll: the directory first, then its files.
    staged = onnx_mlp_model(tmp_path, "copied")
    directory = pool_root / "copied"
    directory.mkdir()
    (directory / "model.yaml").write_text("runtime: onn")  # the poll may read a file still being written
    eventually(lambda: "copied" in models(pool), 20, "the poll did not find the new directory")
    assert models(pool)["copied"]["loadable"] is False
    (directory / "model.onnx").write_bytes((staged / "model.onnx").read_bytes())
    (directory / "model.yaml").write_text((staged / "model.yaml").read_text())
    eventually(lambda: models(pool)["copied"]["loadable"], 20, "the completed copy never became loadable")
    r = httpx.post(f"{pool.url}/v2/models/copied/infer", timeout=60,
                   json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ROW}]})
    assert r.status_code == 200, r.text
