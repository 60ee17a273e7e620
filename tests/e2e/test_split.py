"""The split server from the outside: one engine, two ingress processes on one port.

Whichever ingress a connection reaches, a client sees one server: its requests are served,
/metrics counts all of them, and the processes come back when killed (`kill -9` of an ingress:
the other keeps serving; of the engine: 503 `engine_unavailable` and not ready at once, then
ready again after the supervisor restarted it).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest

from servers import ServerFactory, ServerProcess
from waiting import eventually

DIGIT = {"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                     "data": np.linspace(0, 1, 64, dtype=np.float32).tolist()}]}


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's list)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as file:
            found += [int(p) for p in file.read().split()]
    return found


def roles(supervisor: int) -> dict[str, list[int]]:
    """The supervisor's children by role, from their command lines."""
    out: dict[str, list[int]] = {"engine": [], "ingress": []}
    for pid in children(supervisor):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                argv = file.read().split(b"\0")
        except OSError:
            continue
        if b"servewell.engine_main" in argv or argv[0] == b"servewell engine":  # its process title
            out["engine"].append(pid)
        elif b"servewell.ingress_main" in argv or argv[0].startswith(b"servewell ingress "):
            out["ingress"].append(pid)
    return out


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of a counter's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


@pytest.fixture(scope="module")
def split_server(servewell_cache: Path, start_module_server: ServerFactory) -> ServerProcess:
    server = start_module_server(["--cache-dir", str(servewell_cache), "--ingress-processes", "2"])
    server.wait_ready()
    eventually(lambda: len(roles(server.proc.pid)["ingress"]) == 2 or None, 30, "two ingress processes")
    return server


def infer_on_fresh_connections(server: ServerProcess, count: int) -> list[httpx.Response]:
    """`count` inference requests, each on its own connection (so both ingress processes get some)."""
    answers = []
    for _ in range(count):
        with httpx.Client(base_url=server.url, timeout=10) as client:
            answers.append(client.post("/v2/models/digits/infer", json=DIGIT))
    return answers


def test_every_request_is_served_and_metrics_count_them_all_whichever_ingress(split_server: ServerProcess) -> None:
    before = httpx.get(split_server.url + "/metrics", timeout=10).text
    answers = infer_on_fresh_connections(split_server, 40)
    assert [a.status_code for a in answers] == [200] * 40
    assert all(len(a.json()["outputs"][0]["data"]) == 10 for a in answers)
    after = httpx.get(split_server.url + "/metrics", timeout=10).text
    served = counter(after, "servewell_requests_total", model="digits", outcome="success") - \
        counter(before, "servewell_requests_total", model="digits", outcome="success")
    assert served == 40
    histogram = counter(after, "servewell_preprocess_seconds_count", model="digits") - \
        counter(before, "servewell_preprocess_seconds_count", model="digits")
    assert histogram == 40  # recorded by the ingress processes, summed by the engine
    assert after.count("# TYPE servewell_preprocess_seconds histogram") == 1


def test_every_admin_and_metadata_request_is_counted_once_whichever_ingress(split_server: ServerProcess) -> None:
    # Served by the ingress that accepted it (the engine has no HTTP app: the route's engine part is a
    # control operation), so recorded by that ingress alone and summed by the engine once.
    def counts() -> tuple[float, float]:
        text = httpx.get(split_server.url + "/metrics", timeout=10).text
        return (counter(text, "servewell_request_duration_seconds_count", route="/v2/models/{name}",
                        status_class="2xx"),
                counter(text, "servewell_request_duration_seconds_count",
                        route="/v2/models/{name}/versions/{version}", status_class="4xx"))

    before = counts()
    ids = [f"count-once-{os.getpid()}-{i}" for i in range(12)]
    for request_id in ids:  # each on its own connection: both ingress processes get some
        with httpx.Client(base_url=split_server.url, timeout=10) as client:
            assert client.get("/v2/models/digits").status_code == 200
            missing = client.get("/v2/models/digits/versions/9", headers={"X-Request-ID": request_id})
            assert missing.status_code == 404 and missing.headers["x-request-id"] == request_id
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (12, 12)
    console = httpx.get(split_server.url + "/console/api/state", params={"recent": 200}, timeout=10).json()
    listed = [r["request_id"] for r in console["recent"] if r["request_id"] in ids]
    assert sorted(listed) == sorted(ids)  # each failed request listed once


def test_kill_9_of_an_ingress_leaves_the_other_serving_and_it_comes_back(split_server: ServerProcess) -> None:
    supervisor = split_server.proc.pid
    victim = roles(supervisor)["ingress"][0]
    os.kill(victim, signal.SIGKILL)
    answers = infer_on_fresh_connections(split_server, 10)
    assert [a.status_code for a in answers] == [200] * 10  # the survivor (and the accept queue) serve on

    def replaced() -> list[int] | None:
        pids = roles(supervisor)["ingress"]
        return pids if len(pids) == 2 and victim not in pids else None

    eventually(replaced, 30, "the killed ingress process was not replaced")
    text = httpx.get(split_server.url + "/metrics", timeout=10).text
    assert counter(text, "servewell_process_restarts_total", role="ingress") >= 1
    assert [a.status_code for a in infer_on_fresh_connections(split_server, 10)] == [200] * 10


def test_kill_9_of_the_engine_answers_503_at_once_then_serves_again(split_server: ServerProcess) -> None:
    supervisor = split_server.proc.pid
    (engine,) = roles(supervisor)["engine"]
    os.kill(engine, signal.SIGKILL)

    def refused() -> httpx.Response | None:
        answer = httpx.post(split_server.url + "/v2/models/digits/infer", json=DIGIT, timeout=10)
        return answer if answer.status_code == 503 else None

    answer = eventually(refused, 10, "no 503 after the engine was killed")
    assert answer.json()["code"] in ("engine_unavailable", "model_not_ready")
    assert answer.headers["retry-after"]
    health = httpx.get(split_server.url + "/v2/health/ready", timeout=10)
    assert health.status_code == 503

    split_server.wait_ready(120)
    assert roles(supervisor)["engine"] != [engine]
    assert [a.status_code for a in infer_on_fresh_connections(split_server, 5)] == [200] * 5
    text = httpx.get(split_server.url + "/metrics", timeout=10).text
    assert counter(text, "servewell_process_restarts_total", role="engine") == 1


def test_zero_ingress_processes_is_the_single_process_server(servewell_cache: Path,
                                                             start_server: ServerFactory) -> None:
    server = start_server(["--cache-dir", str(servewell_cache), "--ingress-processes", "0"])
    server.wait_ready()
    assert roles(server.proc.pid) == {"engine": [], "ingress": []}  # no supervisor: the server itself serves
    answers = infer_on_fresh_connections(server, 3)
    assert [a.status_code for a in answers] == [200] * 3
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert counter(text, "servewell_requests_total", model="digits", outcome="success") >= 3
    assert "servewell_process_restarts_total" not in text
