"""Hostile configuration files under a running server (issue 19 items 3, 4, 6, 7, 13, 14; issue
18 item 6): each attack file is put in place, the test asserts the bound (a short reason, a
server that keeps answering, a watcher that keeps polling) and that the rejection is visible in
/healthz, /admin/config and /metrics until a good version is applied."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import yaml
from tritonclient.utils import InferenceServerException

from model_dirs import slow_model
from waiting import eventually

KEY = "hostile-config-key-0123456789"
NEW_KEY = "hostile-config-key-new-987654"


def billion_laughs() -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev, name = chr(96 + i), chr(97 + i)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\ncpu_affinity: *i\n"


DEEP = "cpu_affinity: " + "[" * 600 + "]" * 600 + "\n"  # PyYAML: RecursionError


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("hostile-repo")
    slow_model(root, "slow", 1, max_batch_size=4)
    for name, text in (("deep", DEEP), ("bomb", billion_laughs())):
        (root / name).mkdir()
        (root / name / "model.yaml").write_text(text)
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "outside"
    elsewhere.mkdir()
    (elsewhere / "model.yaml").write_text(yaml.safe_dump({"artifact": "missing.onnx"}))
    (root / "outside").symlink_to(elsewhere)
    conf = tmp_path_factory.mktemp("hostile-conf")
    keys_file = conf / "keys.txt"
    keys_file.write_text(f"team:{KEY}\n")
    (conf / "config.yaml").write_text(yaml.safe_dump({"config_poll_s": 1.0}))
    server = start_module_server(["--model-repository", str(root), "--config", str(conf / "config.yaml"),
                                  "--api-keys-file", str(keys_file)])
    server.wait_live()  # not wait_ready: it stops at the first failed model, and three are meant to fail
    eventually(lambda: httpx.get(server.url + "/healthz", timeout=5).json()["models"]["slow"]["ready"],
               120, "the good model loads beside the hostile ones")
    server.root, server.keys_file = root, keys_file
    return server


def infer(server, key: str | None = KEY) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.post(server.url + "/v2/models/slow/infer", headers=headers, timeout=30, json={
        "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]})


def health(server) -> dict[str, Any]:
    response = httpx.get(server.url + "/healthz", timeout=5)
    assert len(response.content) < 64_000  # a 979-byte model once made it 4.2 MB per request
    doc: dict[str, Any] = response.json()
    return doc


def admin_config(server) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(server.url + "/admin/config", timeout=5).json()["config"]
    return doc


def rejected_files_metric(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("servewell_config_rejected_files ")))


def put(path: Path, data: bytes | str) -> None:
    """Publish by rename, as an editor or kubelet does."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
    os.replace(tmp, path)


def test_hostile_models_at_start_fail_alone_with_a_short_reason(hostile):
    doc = health(hostile)
    models = doc["models"]
    assert models["slow"]["ready"]
    for name, words in (("deep", "deeper than"), ("bomb", "nodes")):
        assert models[name]["state"] != "ready"
        assert words in models[name]["reason"] and len(models[name]["reason"]) < 1000
    index = httpx.post(hostile.url + "/v2/repository/index", headers={"X-API-Key": KEY}, timeout=5)
    assert index.status_code == 200 and len(index.content) < 20_000
    assert "resolves to" in hostile.log() and "outside the repository" in hostile.log()


def test_attack_files_are_rejected_while_serving_and_polling_goes_on(hostile):
    model_yaml = hostile.root / "slow" / "model.yaml"
    good = model_yaml.read_bytes()
    fifo = model_yaml.with_name("fifo.tmp")

    def fifo_in_place() -> None:  # moved into place as model.yaml: froze the server 24.5 s per poll
        os.mkfifo(fifo)
        os.replace(fifo, model_yaml)

    attacks: list[tuple[str, Callable[[], None], str]] = [
        ("deep", lambda: put(model_yaml, DEEP), "deeper than"),
        ("anchors", lambda: put(model_yaml, billion_laughs()), "nodes"),
        ("big", lambda: put(model_yaml, b"# comment\n" * 1_100_000), "over the limit"),
        ("non-utf8", lambda: put(model_yaml, good + b"# \xff\n"), "utf-8"),
        ("fifo", fifo_in_place, "FIFO"),
    ]
    for name, attack, words in attacks:
        attack()
        started = time.monotonic()
        while time.monotonic() - started < 2.0:  # the loop answers across polls (a FIFO froze it 24.5 s)
            assert httpx.get(hostile.url + "/v2/health/live", timeout=2).status_code == 200
            time.sleep(0.1)
        entry = eventually(lambda: [r for r in health(hostile)["config"]["rejected"]
                                    if r["file"] == "slow/model.yaml"], 20, f"{name} rejected")
        assert words.lower() in entry[0]["reason"].lower(), (name, entry)
        assert len(entry[0]["reason"]) < 400 and health(hostile)["status"] == "degraded"
        assert health(hostile)["ready"] and infer(hostile).status_code == 200
        assert admin_config(hostile)["rejected"][0]["path"] == str(model_yaml)
        assert rejected_files_metric(hostile) >= 1
        put(model_yaml, good)  # the next attack must be a change again
        eventually(lambda: not health(hostile)["config"]["rejected"], 20, f"{name} cleared by a good version")
    assert max(len(line) for line in hostile.log().splitlines()) < 4000  # a 464 MB log line, once


def test_a_half_written_model_yaml_is_applied_only_whole(hostile):
    model_yaml = hostile.root / "slow" / "model.yaml"
    doc = yaml.safe_load(model_yaml.read_text())
    doc["batching"] = {"max_wait_ms": 3}
    prefix = yaml.safe_dump(doc)  # valid on its own: a change of batching only
    rest = yaml.safe_dump({"metadata": {"edition": "whole"}})
    before = hostile.log().count("model.yaml changed:")
    waiting = hostile.log().count("applied once it stays unchanged")
    with open(model_yaml, "w") as f:  # the writer pauses mid-file (no rename)
        f.write(prefix)
        f.flush()
        eventually(lambda: hostile.log().count("applied once it stays unchanged") > waiting, 20, "seen, waiting",
                   interval_s=0.05)
        f.write(rest)
    eventually(lambda: hostile.log().count("model.yaml changed:") > before, 20, "the whole file applied")
    time.sleep(2.5)  # two more polls: a second apply (the prefix, then the whole) would show by now
    assert hostile.log().count("model.yaml changed:") == before + 1
    models = httpx.get(hostile.url + "/admin/config", timeout=5).json()["models"]
    assert models["slow"]["config"]["metadata"] == {"edition": "whole"}
    assert infer(hostile).status_code == 200


def test_keys_fail_closed_and_a_broken_keys_file_never_stops_the_watcher(hostile):
    assert infer(hostile, None).status_code == 401 and infer(hostile).status_code == 200
    put(hostile.keys_file, b"team:" + KEY.encode() + b"\xff\n")  # one non-UTF-8 byte
    eventually(lambda: any(r["file"] == "keys.txt" for r in health(hostile)["config"]["rejected"]),
               20, "non-UTF-8 keys file rejected")
    assert infer(hostile).status_code == 200  # the keys in force stay
    put(hostile.keys_file, "# every key revoked\n")  # the revocation of the last key
    eventually(lambda: infer(hostile).status_code == 401, 20, "the revoked key refused")
    assert infer(hostile, None).status_code == 401  # never open
    # The console's data: a client that is not an operator (here: one a proxy forwarded, so not a trusted
    # loopback client) needs a key, and none is in force; the loopback operator still sees the server.
    state = httpx.get(hostile.url + "/console/api/state", headers={"X-Forwarded-For": "203.0.113.7"}, timeout=5)
    assert state.status_code == 401
    assert httpx.get(hostile.url + "/console/api/state", timeout=5).status_code == 200
    tensor = triton_grpc.InferInput("x", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    with triton_grpc.InferenceServerClient(hostile.grpc_url) as client:  # gRPC denies as HTTP does
        with pytest.raises(InferenceServerException) as refused:
            client.infer("slow", [tensor], headers={"x-api-key": KEY})
    assert str(refused.value.status()) == "StatusCode.UNAUTHENTICATED"
    # /healthz is public: a keys file's reason is the operator's (GET /admin/config), not everyone's
    public = [r["reason"] for r in health(hostile)["config"]["rejected"] if r["file"] == "keys.txt"]
    assert public and "see GET /admin/config" in public[0]
    report = httpx.get(hostile.url + "/admin/config", timeout=5).json()["config"]
    reasons = [r["reason"] for r in report["rejected"] if r["file"] == "keys.txt"]
    assert reasons and "no API key is in force" in reasons[0]
    assert "rejected, every request that needs an API key is refused" in hostile.log()
    put(hostile.keys_file, f"new:{NEW_KEY}\n")  # the watcher still polls: a new key applies
    eventually(lambda: infer(hostile, NEW_KEY).status_code == 200, 20, "the new key in force")
    assert not [r for r in health(hostile)["config"]["rejected"] if r["file"] == "keys.txt"]
    assert infer(hostile, KEY).status_code == 401
