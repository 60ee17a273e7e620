"""Config hot reload: the --config file and model.yaml files change under a running server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from model_dirs import slow_model
from waiting import eventually


def edit_yaml(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def body(value: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}


@pytest.fixture(scope="module")
def live(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("reload-repo")
    slow_model(root, "slow", 20, max_batch_size=4)
    # kubelet's ConfigMap layout: config.yaml -> ..data/config.yaml, ..data -> ..<version>/
    conf_dir = tmp_path_factory.mktemp("configmap")
    first = conf_dir / "..v1"
    first.mkdir()
    (first / "config.yaml").write_text(yaml.safe_dump({"config_poll_s": 0.3, "slow_request_ms": 10_000}))
    (conf_dir / "..data").symlink_to("..v1")
    (conf_dir / "config.yaml").symlink_to("..data/config.yaml")
    server = start_module_server(["--model-repository", str(root), "--config", str(conf_dir / "config.yaml")])
    server.wait_ready()
    server.root, server.conf_dir = root, conf_dir
    return server


def batching(server) -> dict[str, Any]:
    return httpx.get(server.url + "/admin/models/slow/batching").json()


def report(server) -> dict[str, Any]:
    return httpx.get(server.url + "/admin/config").json()


def test_a_valid_model_yaml_edit_applies_live(live):
    before = report(live)["models"]["slow"]["loaded_at"]
    pids = [i["pid"] for i in httpx.get(live.url + "/healthz").json()["models"]["slow"]["instances"]]
    edit_yaml(live.root / "slow" / "model.yaml",
              lambda d: d.update(batching={"policy": "window", "max_wait_ms": 7, "max_queue_size": 1}))
    eventually(lambda: batching(live)["policy"] == "window", 15, "the batching policy from the file")
    assert batching(live)["max_wait_ms"] == 7 and report(live)["models"]["slow"]["loaded_at"] > before
    # Same workers (nothing reloaded), and the new bound shows in behaviour: a queue of 1 refuses a burst.
    assert [i["pid"] for i in httpx.get(live.url + "/healthz").json()["models"]["slow"]["instances"]] == pids

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            answers = await asyncio.gather(*(c.post("/v2/models/slow/infer", json=body(i)) for i in range(12)))
        return [a.status_code for a in answers]

    codes = asyncio.run(burst())
    assert set(codes) <= {200, 503} and 503 in codes, codes
    edit_yaml(live.root / "slow" / "model.yaml", lambda d: d.update(batching={"policy": "idle"}))
    eventually(lambda: batching(live)["policy"] == "idle" and batching(live)["max_queue_size"] == 256, 15,
               "the file's batching back in force")


def test_an_invalid_model_yaml_is_refused_and_the_old_config_keeps_serving(live):
    path = live.root / "slow" / "model.yaml"
    good = path.read_text()
    edit_yaml(path, lambda d: d.update(max_batch_size=-3))
    eventually(lambda: "model.yaml rejected" in live.log(), 15, "a log line about the rejected file")
    line = next(line for line in live.log().splitlines() if "model.yaml rejected" in line)
    assert str(path) in line and "max_batch_size" in line  # the file, the field and the reason
    assert httpx.post(live.url + "/v2/models/slow/infer", json=body(1)).status_code == 200
    assert batching(live)["max_batch_size"] == 4
    path.write_text(good)


def test_a_change_that_needs_new_workers_reloads_with_zero_failures_under_load(live):
    pids = {i["pid"] for i in httpx.get(live.url + "/healthz").json()["models"]["slow"]["instances"]}

    async def load(stop: asyncio.Event) -> list[int]:
        codes: list[int] = []
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
            async def client(k: int) -> None:
                while not stop.is_set():
                    codes.append((await c.post("/v2/models/slow/infer", json=body(k))).status_code)
            await asyncio.gather(*(client(k) for k in range(6)))
        return codes

    async def main() -> list[int]:
        stop = asyncio.Event()
        traffic = asyncio.create_task(load(stop))
        await asyncio.sleep(0.5)
        edit_yaml(live.root / "slow" / "model.yaml", lambda d: d["pytorch"]["factory_kwargs"].update(delay_ms=5))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = httpx.get(live.url + "/healthz").json()["models"]["slow"]
            if {i["pid"] for i in health["instances"]} - pids and health["state"] == "ready":
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        stop.set()
        return await traffic

    codes = asyncio.run(main())
    assert len(codes) > 50 and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
    new = {i["pid"] for i in httpx.get(live.url + "/healthz").json()["models"]["slow"]["instances"]}
    assert not new & pids  # new workers serve
    eventually(lambda: "reloaded" in live.log(), 15, "the reload's log line (after the old version drained)")


def test_admin_patch_lasts_until_the_file_changes(live):
    patched = httpx.patch(live.url + "/admin/models/slow/batching", json={"max_wait_ms": 42, "policy": "window"})
    assert patched.status_code == 200
    assert report(live)["models"]["slow"]["overrides"] == {"max_wait_ms": 42, "policy": "window"}
    edit_yaml(live.root / "slow" / "model.yaml", lambda d: d.update(batching={"policy": "idle", "max_wait_ms": 3}))
    eventually(lambda: batching(live)["max_wait_ms"] == 3, 15, "the file's max_wait_ms in force")
    assert batching(live)["policy"] == "idle" and report(live)["models"]["slow"]["overrides"] == {}
    assert "admin overrides" in live.log()


def test_a_configmap_symlink_swap_of_the_config_file_applies_live_settings(live):
    assert report(live)["server"]["settings"]["slow_request_ms"] == 10_000
    second = live.conf_dir / "..v2"
    second.mkdir()
    (second / "config.yaml").write_text(yaml.safe_dump({"config_poll_s": 0.3, "slow_request_ms": 1,
                                                        "log_level": "debug", "port": 1234,
                                                        "max_body_bytes": 2_000_000}))
    (live.conf_dir / "..data_tmp").symlink_to("..v2")
    os.replace(live.conf_dir / "..data_tmp", live.conf_dir / "..data")
    eventually(lambda: report(live)["server"]["settings"]["slow_request_ms"] == 1, 15, "slow_request_ms")
    server = report(live)["server"]
    assert server["settings"]["log_level"] == "debug"
    # max_body_bytes needs a restart; the port also comes from a --port flag, which wins over the file.
    assert server["pending_restart"] == ["max_body_bytes"] and server["settings"]["port"] == live.port
    assert httpx.post(live.url + "/v2/models/slow/infer", json=body(1)).status_code == 200
    eventually(lambda: "slow request" in live.log(), 15, "the new slow-request threshold in force")
    assert "need a restart" in live.log()


def test_an_invalid_config_file_is_refused_and_sighup_rereads(live):
    target = (live.conf_dir / "config.yaml").resolve()
    target.write_text(yaml.safe_dump({"config_poll_s": 0, "log_level": "loud"}))
    eventually(lambda: "config file rejected" in live.log(), 15, "a log line about the rejected config file")
    assert "log_level" in next(line for line in live.log().splitlines() if "config file rejected" in line)
    assert report(live)["server"]["settings"]["log_level"] == "debug"  # kept
    # Polling off: only SIGHUP makes the server look.
    target.write_text(yaml.safe_dump({"config_poll_s": 0, "slow_request_ms": 500}))
    eventually(lambda: report(live)["server"]["settings"]["config_poll_s"] == 0, 15, "polling turned off")
    target.write_text(yaml.safe_dump({"config_poll_s": 0, "slow_request_ms": 700}))
    time.sleep(1.0)
    assert report(live)["server"]["settings"]["slow_request_ms"] == 500  # not polled any more
    live.proc.send_signal(signal.SIGHUP)
    eventually(lambda: report(live)["server"]["settings"]["slow_request_ms"] == 700, 15, "SIGHUP reload")
