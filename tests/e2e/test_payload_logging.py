"""The payload log (issue 24) through a real split server: requests over HTTP reach the JSONL file
and a CloudEvents receiver (tests/support/event_receiver.py), every one counted in /metrics; the
section changes live, and a sink that cannot be opened is refused, at start and at reload; a sink
that fails (a full disk) is warned about once a minute and shown in /healthz and /metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from event_receiver import EventReceiver
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from tiny_models import write_tiny_model
from waiting import eventually

REQUESTS = 20


@pytest.fixture(scope="module")
def receiver() -> Any:
    started = EventReceiver()
    yield started
    started.close()


def payload_settings(log_path: Path, receiver: EventReceiver, **fields: Any) -> dict[str, Any]:
    return {"config_poll_s": 0.3, "payload_log": {
        "enabled": True, "file": {"path": str(log_path)}, "http": {"url": receiver.url, "source": "e2e"},
        **fields}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory,
           receiver: EventReceiver) -> ServerProcess:
    root = tmp_path_factory.mktemp("payload-repo")
    write_tiny_model(root, "tiny")
    write_tiny_model(root, "other")
    conf = tmp_path_factory.mktemp("payload-conf")
    log_path = conf / "payload.jsonl"
    (conf / "server.yaml").write_text(yaml.safe_dump(payload_settings(log_path, receiver, models=["tiny"])))
    started = start_module_server(["--model-repository", str(root), "--config", str(conf / "server.yaml"),
                                   "--ingress-processes", "2"])
    started.wait_ready()
    started.conf = conf  # type: ignore[attr-defined]
    return started


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def at_least(path: Path, count: int) -> list[dict[str, Any]] | None:
    """The file's records once it holds `count` (None before)."""
    records = lines(path)
    return records if len(records) >= count else None


def infer(server: ServerProcess, model: str, value: float, request_id: str) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    response = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, headers={"X-Request-ID": request_id},
                          timeout=30)
    assert response.status_code == 200, response.text
    return response


def test_every_request_reaches_the_file_and_the_cloudevents_sink(server: ServerProcess, receiver: EventReceiver):
    log_path = server.conf / "payload.jsonl"  # type: ignore[attr-defined]
    for i in range(REQUESTS):
        infer(server, "tiny", float(i), f"req-{i}")
    infer(server, "other", 1.0, "not-logged")  # payload_log.models names tiny only
    records = eventually(lambda: at_least(log_path, REQUESTS), 15, "the records written")
    assert [r["request_id"] for r in records] == [f"req-{i}" for i in range(REQUESTS)]
    for i, r in enumerate(records):
        assert r["model"] == "tiny" and r["version"] == "1" and r["status"] == 200
        assert r["inputs"]["x"] == {"datatype": "FP32", "shape": [1, 1], "data": [float(i)]}
        assert r["outputs"]["y"] == {"datatype": "FP32", "shape": [1, 1], "data": [2.0 * i]}
    eventually(lambda: len(receiver.of_type("org.kubeflow.serving.inference.response")) >= REQUESTS, 15,
               "the events received")
    requests = receiver.of_type("org.kubeflow.serving.inference.request")
    responses = receiver.of_type("org.kubeflow.serving.inference.response")
    assert sorted(p.headers["ce-id"] for p in requests) == sorted(f"req-{i}" for i in range(REQUESTS))
    event = next(p for p in responses if p.headers["ce-id"] == "req-3")
    assert event.headers["ce-source"] == "e2e" and event.headers["ce-inferenceservicename"] == "tiny"
    assert event.headers["ce-specversion"] == "1.0" and event.headers["content-type"] == "application/json"
    assert event.json()["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [6.0]}]
    for sink in ("file", "http"):
        assert scraped_total(server.url, "servewell_payload_log_records_total", sink=sink,
                             outcome="written") == REQUESTS
        assert scraped_total(server.url, "servewell_payload_log_records_total", sink=sink, outcome="dropped") == 0


def test_a_change_applies_live_and_a_sink_that_cannot_open_is_refused(server: ServerProcess,
                                                                       receiver: EventReceiver):
    conf: Path = server.conf  # type: ignore[attr-defined]
    log_path = conf / "payload.jsonl"
    report = lambda: httpx.get(server.url + "/admin/config", timeout=10).json()  # noqa: E731
    (conf / "server.yaml").write_text(yaml.safe_dump(payload_settings(log_path, receiver, redact=["x"])))
    eventually(lambda: report()["server"]["settings"]["payload_log"]["redact"] == ["x"], 20, "the change applied")
    assert "**" in json.dumps(report()["server"]["settings"]["payload_log"]["http"]["url"])  # never the URL
    before = len(lines(log_path))
    infer(server, "other", 4.0, "other-now-logged")
    record = eventually(lambda: at_least(log_path, before + 1), 15, "the record")[-1]
    assert record["request_id"] == "other-now-logged" and record["inputs"]["x"]["data"] == "[redacted]"

    missing = conf / "no-such-dir" / "payload.jsonl"
    (conf / "server.yaml").write_text(yaml.safe_dump(payload_settings(missing, receiver, redact=["x"])))
    eventually(lambda: server.health().get("config", {}).get("status") == "degraded"
               or "payload log is kept" in server.log(), 20, "the change rejected")
    assert report()["server"]["settings"]["payload_log"]["file"]["path"] == str(log_path)
    infer(server, "tiny", 5.0, "still-logged")
    eventually(lambda: lines(log_path)[-1]["request_id"] == "still-logged", 15, "the running log kept")


def test_a_full_disk_is_warned_once_a_minute_and_shown_in_healthz_and_metrics(server: ServerProcess,
                                                                              receiver: EventReceiver):
    """Issue 45, H8: a full disk under the file sink logged one warning per failed batch (82 in 10 s)
    and /healthz said "ok". /dev/full stands for the full disk (every write: ENOSPC)."""
    conf: Path = server.conf  # type: ignore[attr-defined]
    full = conf / "full.jsonl"
    full.symlink_to("/dev/full")
    failed = lambda: scraped_total(server.url, "servewell_payload_log_records_total",  # noqa: E731
                                   sink="file", outcome="failed")
    (conf / "server.yaml").write_text(yaml.safe_dump(payload_settings(full, receiver)))
    eventually(lambda: httpx.get(server.url + "/admin/config", timeout=10).json()["server"]["settings"]
               ["payload_log"]["file"]["path"] == str(full), 20, "the change applied")
    before = failed()
    for i in range(6):  # one request a batch: each waits until the one before has failed
        infer(server, "tiny", float(i), f"full-{i}")
        wanted = before + i + 1
        eventually(lambda: failed() >= wanted, 15, "the write failed")  # noqa: B023 (called at once)
    health = server.health()
    assert health["status"] == "degraded" and health["ready"] is True  # records are lost, requests are served
    sink = health["payload_log"]["sinks"]["file"]
    assert health["payload_log"]["status"] == "failing" and sink["failing"] is True
    assert sink["problem"] == "ENOSPC: No space left on device" and sink["failed_records"] >= 6
    assert str(conf) not in json.dumps(health)  # /healthz is open: no path
    assert scraped_total(server.url, "servewell_payload_log_sink_failing", sink="file") == 1
    warned = [line for line in server.log().splitlines() if str(full) in line and "WARNING" in line.upper()]
    assert len(warned) == 1, warned  # six batches failed

    log_path = conf / "payload.jsonl"
    (conf / "server.yaml").write_text(yaml.safe_dump(payload_settings(log_path, receiver, models=["tiny"])))
    eventually(lambda: server.health()["status"] == "ok", 20, "the working file sink in force again")
    assert scraped_total(server.url, "servewell_payload_log_sink_failing", sink="file") == 0
    assert log_path.stat().st_mode & 0o777 == 0o600  # H12: created for the server's user only


def test_a_server_whose_payload_file_cannot_be_opened_does_not_start(tmp_path: Path, start_server: ServerFactory,
                                                                      receiver: EventReceiver):
    root = tmp_path / "repo"
    write_tiny_model(root, "tiny")
    (tmp_path / "server.yaml").write_text(yaml.safe_dump(
        payload_settings(tmp_path / "missing" / "payload.jsonl", receiver)))
    server = start_server(["--model-repository", str(root), "--config", str(tmp_path / "server.yaml")])
    eventually(server.exited, 60, lambda: f"the server still runs:\n{server.log()[-2000:]}")
    assert server.proc.returncode != 0
    assert "payload_log" in server.log() and "not writable" in server.log()
