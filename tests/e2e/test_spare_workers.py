"""A server started with `--spare-workers 1`: a model loaded through the repository API takes the
spare worker (its worker's pid is the spare's, per the log) and answers what the model computes;
no spare outlives the server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import torch

from model_dirs import infer_body, onnx_linear_model
from waiting import eventually


def events(log: str, event: str) -> list[dict]:
    """The JSON log lines of `event`."""
    found = []
    for line in log.splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                found.append(doc)
    return found


def process_gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


def test_a_loaded_model_takes_the_spare_worker_and_no_spare_outlives_the_server(tmp_path, start_server):
    onnx_linear_model(tmp_path, "first")
    server = start_server(["--model-repository", str(tmp_path), "--spare-workers", "1", "--config-poll-s", "0"])
    server.wait_ready()
    (first,) = [doc for doc in events(server.log(), "worker_cold_start") if doc["model"] == "first"]
    # The spare the first load took (ready or not) is replaced; the next load takes the replacement.
    eventually(lambda: [d for d in events(server.log(), "spare_ready") if d["pid"] != first["pid"]], 120,
               lambda: server.log()[-3000:])
    onnx_linear_model(tmp_path, "second")
    r = httpx.post(server.url + "/v2/repository/models/second/load", timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v2/models/second/infer", json=infer_body(2.0), timeout=30)
    assert r.status_code == 200, r.text
    torch.manual_seed(0)
    expected = torch.nn.Linear(1, 1)(torch.tensor([[2.0]])).item()
    assert abs(r.json()["outputs"][0]["data"][0] - expected) < 1e-5

    log = server.log()
    spare_pids = {doc["pid"] for doc in events(log, "spare_ready")}
    (start,) = [doc for doc in events(log, "worker_cold_start") if doc["model"] == "second"]
    assert start["spare"] is True and start["pid"] in spare_pids
    assert {"spawn_s", "import_s", "load_s", "warmup_s"} <= start.keys()

    server.stop()
    ends_at = time.monotonic() + 30
    while not all(process_gone(pid) for pid in spare_pids) and time.monotonic() < ends_at:
        time.sleep(0.05)
    assert all(process_gone(pid) for pid in spare_pids), [p for p in spare_pids if not process_gone(p)]
