"""Loading within a memory budget, load timeouts, memory-limit recycling, and live reloads."""

from __future__ import annotations

import asyncio
import textwrap

import httpx

from error_bodies import error_code
from model_dirs import factory_model, slow_model
from model_dirs import infer_body as body
from model_dirs import onnx_linear_model as onnx_model
from waiting import eventually

HANGING = textwrap.dedent('''
    import time
    from torch import nn

    def build():
        time.sleep(600)  # a load that never finishes
        return nn.Linear(1, 1)
''')

LEAKY = textwrap.dedent('''
    import torch
    from torch import nn

    class Leaky(nn.Module):
        """Keeps 200 MB per real (non-zero) batch: a slow memory leak."""

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.kept = []

        def forward(self, x):
            if bool((x != 0).any()):
                self.kept.append(torch.ones(50_000_000))
            return x * self.scale

    def build():
        return Leaky()
''')


def wait_settled(url: str, names: list[str], timeout_s: float = 90) -> dict:
    """The models of /healthz once each of `names` is ready, failed or invalid."""
    def settled() -> dict | None:
        models = httpx.get(url + "/healthz").json()["models"]
        return models if all(models[n]["state"] in ("ready", "failed", "invalid") for n in names) else None

    return eventually(settled, timeout_s, f"{names} did not finish loading")


def test_model_over_the_memory_budget_is_refused_while_another_serves(tmp_path, start_server):
    onnx_model(tmp_path, "small")
    slow_model(tmp_path, "big_torch", 1, max_batch_size=1, instances=2)
    server = start_server(["--model-repository", str(tmp_path), "--memory-budget-bytes", str(300 << 20)])
    server.wait_live()
    models = wait_settled(server.url, ["small", "big_torch"])
    assert models["small"]["state"] == "ready"
    reason = models["big_torch"]["reason"]
    assert models["big_torch"]["state"] == "failed"
    assert "big_torch" in reason and "MiB" in reason and "300 MiB memory budget" in reason
    r = httpx.post(server.url + "/v2/models/small/infer", json=body(2.0))
    assert r.status_code == 200


BROKEN = textwrap.dedent('''
    def build():
        raise RuntimeError("weights do not match the architecture")
''')


def test_a_new_model_that_fails_to_load_stays_listed_as_failed_with_its_reason(tmp_path, start_server):
    onnx_model(tmp_path, "small")
    server = start_server(["--model-repository", str(tmp_path), "--config-poll-s", "0"])
    server.wait_ready()
    factory_model(tmp_path, "broken", BROKEN)
    r = httpx.post(server.url + "/v2/repository/models/broken/load", timeout=120)
    assert r.status_code == 422 and error_code(r) == "load_failed"
    health = server.health()
    assert health["ready"] is True  # readiness `any`: the other model keeps the server in rotation
    assert health["models"]["broken"]["state"] == "failed"
    assert "weights do not match the architecture" in health["models"]["broken"]["reason"]
    index = {m["name"]: m for m in httpx.post(server.url + "/v2/repository/index").json()}
    assert index["broken"]["state"] == "UNAVAILABLE" and "weights do not match" in index["broken"]["reason"]
    refused = httpx.post(server.url + "/v2/models/broken/infer", json=body(1.0))
    assert refused.status_code == 503 and error_code(refused) == "model_not_ready"
    assert httpx.post(server.url + "/v2/models/small/infer", json=body(1.0)).status_code == 200


def test_a_hanging_load_is_killed_at_the_timeout(tmp_path, start_server):
    onnx_model(tmp_path, "small")
    factory_model(tmp_path, "hangs", HANGING)
    # One attempt: a load that timed out is tried again (test_worker_starts covers that), 51 s in all.
    server = start_server(["--model-repository", str(tmp_path), "--load-timeout-s", "15", "--load-attempts", "1"])
    server.wait_live()
    models = wait_settled(server.url, ["small", "hangs"])
    assert models["hangs"]["state"] == "failed" and "within 15 s" in models["hangs"]["reason"]
    # The kill is a signal: the frontend sees the process gone when its pipe closes, just after.
    eventually(lambda: server.health()["models"]["hangs"]["instances"][0]["alive"] is False, 10,
               "the hanging worker was not killed")
    assert httpx.post(server.url + "/v2/models/small/infer", json=body(1.0)).status_code == 200


def test_worker_over_its_memory_limit_is_drained_and_replaced(tmp_path, start_server):
    # The deprecated name of host_memory_limit_bytes, still read (with a warning in the log).
    factory_model(tmp_path, "leaky", LEAKY, max_batch_size=1, memory_limit_bytes=1200 << 20)
    server = start_server(["--model-repository", str(tmp_path)])
    server.wait_ready()
    first_pid = httpx.get(server.url + "/healthz").json()["models"]["leaky"]["instances"][0]["pid"]
    codes = [httpx.post(server.url + "/v2/models/leaky/infer", json=body(1.0), timeout=60).status_code
             for _ in range(12)]
    assert set(codes) == {200}  # draining loses nothing

    def replaced() -> dict | None:
        model = server.health()["models"]["leaky"]
        return model if model["recycles"] >= 1 and model["state"] == "ready" \
            and model["instances"][0]["pid"] != first_pid else None

    model = eventually(replaced, 60, "the leaky worker was not recycled")
    # A replacement for memory is a restart like the others, counted by its cause (issue 47).
    assert model["restarts_by_reason"] == {"crash": 0, "hung": 0, "memory": model["recycles"]}, model
    assert model["restarts"] == model["recycles"], model
    (event, *_) = model["replacements"]
    assert event["reason"] == "memory" and "exceeds host_memory_limit_bytes" in event["detail"], event
    assert event["gap_s"] is not None and event["gap_s"] > 0 and event["clients_waited"], event
    # 60 s like the calls above: a fresh worker on a loaded machine took over httpx's default 5 s.
    assert httpx.post(server.url + "/v2/models/leaky/infer", json=body(0.0), timeout=60).status_code == 200
    assert "exceeds host_memory_limit_bytes" in server.log()
    assert "memory_limit_bytes is deprecated; it means host_memory_limit_bytes" in server.log()


def test_reload_under_load_has_zero_failed_requests_and_needs_the_admin_token(tmp_path, start_server):
    onnx_model(tmp_path, "live", version="1")
    server = start_server(["--model-repository", str(tmp_path), "--admin-token", "s3cret"])
    server.wait_ready()
    load_url = server.url + "/v2/repository/models/live/load"
    assert httpx.post(load_url).status_code == 401
    assert httpx.post(load_url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    onnx_model(tmp_path, "live", version="2")  # a new version appears in the repository

    async def main():
        answers: list[int] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async def user():
                while not stop.is_set():
                    r = await client.post("/v2/models/live/infer", json=body(1.0))
                    answers.append(r.status_code)

            users = [asyncio.create_task(user()) for _ in range(6)]
            await asyncio.sleep(0.5)
            reload = await client.post("/v2/repository/models/live/load", headers={"Authorization": "Bearer s3cret"},
                                       timeout=120)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*users)
        return reload, answers

    reload, answers = asyncio.run(main())
    assert reload.status_code == 200 and reload.json()["version"] == "2", reload.text
    assert answers and set(answers) == {200}, {c: answers.count(c) for c in set(answers)}
    assert httpx.get(server.url + "/v2/models/live").json()["versions"] == ["2"]
    unload = httpx.post(server.url + "/v2/repository/models/live/unload", headers={"Authorization": "Bearer s3cret"})
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
    r = httpx.post(server.url + "/v2/models/live/infer", json=body(1.0))
    assert r.status_code == 503 and error_code(r) == "model_not_ready"
    index = httpx.post(server.url + "/v2/repository/index").json()
    assert [{k: m[k] for k in ("name", "version", "state", "reason")} for m in index] == [
        {"name": "live", "version": "2", "state": "UNAVAILABLE", "reason": "unloaded by an operator"}]
    assert index[0]["residency"] == "not_loaded" and index[0]["loadable"] is False  # the pool's fields beside



def test_unload_under_load_answers_model_unloading_never_shutting_down(tmp_path, start_server):
    # 200 ms a batch, one row at a time: 8 users keep a queue whose drain takes over a second, and
    # requests arriving during that drain meet a model being unloaded (issue 19.17: they were told
    # `shutting_down` by a server that was not shutting down).
    slow_model(tmp_path, "draining", 200, max_batch_size=1)
    server = start_server(["--model-repository", str(tmp_path), "--config-poll-s", "0"])
    server.wait_ready()
    batching_url = server.url + "/admin/models/draining/batching"

    async def main():
        answers: list[tuple[int, str | None, str | None]] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def user():
                while not stop.is_set():
                    r = await client.post("/v2/models/draining/infer", json=body(1.0))
                    error = r.json() if r.status_code != 200 else {}  # OIP shape: {"error": message, "code", ...}
                    answers.append((r.status_code, error.get("code"), r.headers.get("retry-after")))
                    if r.status_code != 200:
                        await asyncio.sleep(0.02)

            users = [asyncio.create_task(user()) for _ in range(8)]
            await asyncio.sleep(1.0)
            unload = await client.post("/v2/repository/models/draining/unload", timeout=120)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*users)
        return unload, answers

    unload, answers = asyncio.run(main())
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded", unload.text
    counts = {(status, code): sum(1 for a in answers if a[:2] == (status, code)) for status, code, _ in answers}
    assert counts.get((200, None), 0) >= 4, counts
    # The drain window was real: requests met the model while it was being unloaded...
    assert counts.get((503, "model_unloading"), 0) >= 1, counts
    # ...and every refusal named the model's state, with a retry hint; none said shutting_down.
    assert set(counts) <= {(200, None), (503, "model_unloading"), (503, "model_not_ready")}, counts
    assert all(retry is not None and int(retry) >= 1 for status, _, retry in answers if status == 503)

    # A live settings change on an unloaded model applies to nothing: 409 naming the state.
    patched = httpx.patch(batching_url, json={"max_wait_ms": 5})
    assert patched.status_code == 409, patched.text
    error = patched.json()["error"]
    assert error["code"] == "conflict" and "is unloaded" in error["message"], error
    # Loaded again, it serves and takes settings again.
    assert httpx.post(server.url + "/v2/repository/models/draining/load", timeout=120).status_code == 200
    assert httpx.patch(batching_url, json={"max_wait_ms": 5}).status_code == 200
    assert httpx.post(server.url + "/v2/models/draining/infer", json=body(2.0), timeout=30).status_code == 200
