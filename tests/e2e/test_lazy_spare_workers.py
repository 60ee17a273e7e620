"""A lazy server with its defaults for fast cold starts (one spare worker, warm-up of the first
batch sizes; loads at normal priority): each model's first request loads it on the spare (its
worker's pid is the spare's, per the log), warmed up at batch sizes 1 and 2 only, and gets what
the model computes; the spare is replaced for the next model; no spare outlives the server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import torch

from faults import engine_pids
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


def test_first_requests_load_their_models_on_spare_workers_and_no_spare_outlives_the_server(tmp_path, start_server):
    for name in ("first", "second"):
        onnx_linear_model(tmp_path, name)  # max_batch_size 8
    # Loads at normal priority: at the lazy default (idle), a load starved of a core on a busy machine
    # starts over on a worker forked for the retry, not the ready spare this test follows (seen under
    # `make test`; the restart is tests/integration/workers/test_load_priority.py's subject).
    server = start_server(["--model-repository", str(tmp_path), "--repository-mode", "lazy", "--config-poll-s", "0",
                           "--load-cpu-policy", "normal"])
    server.wait_ready()
    torch.manual_seed(0)
    expected = torch.nn.Linear(1, 1)(torch.tensor([[2.0]])).item()
    adopted: set[int] = set()
    for name in ("first", "second"):
        # The spare the previous load took is replaced once that load is over; wait for it to be ready.
        eventually(lambda: [d for d in events(server.log(), "spare_ready") if d["pid"] not in adopted], 120,
                   lambda: server.log()[-3000:])
        r = httpx.post(f"{server.url}/v2/models/{name}/infer", json=infer_body(2.0), timeout=60)
        assert r.status_code == 200, r.text
        assert abs(r.json()["outputs"][0]["data"][0] - expected) < 1e-5
        log = server.log()
        (start,) = [doc for doc in events(log, "worker_cold_start") if doc["model"] == name]
        assert start["spare"] is True and start["pid"] in {d["pid"] for d in events(log, "spare_ready")}, log[-6000:]
        assert {"spawn_s", "import_s", "load_s", "warmup_s"} <= start.keys()
        adopted.add(start["pid"])
        stages = [line for line in log.splitlines() if f'"model":"{name}"' in line and '"stage"' in line]
        assert any("warmed up batch sizes 1..2 only" in line for line in stages), stages
    assert len(adopted) == 2

    # Every spare is forked from one fork server (which imported the runtime once), a child of the
    # engine: a refill is a fork, not an interpreter start and the imports.
    spare_pids = {doc["pid"] for doc in events(server.log(), "spare_ready")}
    (fork_server,) = {parent_of(pid) for pid in spare_pids if not process_gone(pid)}
    assert "forkserver" in Path(f"/proc/{fork_server}/cmdline").read_bytes().decode()
    assert parent_of(fork_server) in engine_pids(server)
    # It forks with no onnxruntime telemetry thread or event database to inherit: `servewell` turns
    # that telemetry off in its processes unless the user set the switch.
    assert b"ORT_DISABLE_TELEMETRY=1" in Path(f"/proc/{fork_server}/environ").read_bytes().split(b"\0")
    assert "onnxruntime.db" not in Path(f"/proc/{fork_server}/maps").read_text()
    server.stop()
    ends_at = time.monotonic() + 30
    every = spare_pids | {fork_server}
    while not all(process_gone(pid) for pid in every) and time.monotonic() < ends_at:
        time.sleep(0.05)
    assert all(process_gone(pid) for pid in every), [p for p in every if not process_gone(p)]


def parent_of(pid: int) -> int:
    """The parent process id of `pid`, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
