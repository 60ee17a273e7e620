"""The payload log with its real sinks: a JSONL file in tmp_path and a CloudEvents receiver on
127.0.0.1 (tests/support/event_receiver.py). `close()` writes what is queued, so each test reads
what the sinks got after it."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from event_receiver import EventReceiver
from servewell.config.payload_log import PayloadLogConfig
from servewell.config.server import ServerConfig
from servewell.observability.payload_log import PayloadLog, PayloadLogCollector
from servewell.observability.payload_sinks import SinkHealth
from waiting import eventually

X = np.arange(8, dtype=np.float32).reshape(1, 8)
Y = np.array([[0.25, 0.75]], dtype=np.float32)


class Refused(Exception):
    """Stands for a servewell error: a status and a stable code."""

    status, code = 503, "overloaded"


def settings(tmp_path: Path, **fields: Any) -> PayloadLogConfig:
    return PayloadLogConfig.model_validate({"enabled": True, "file": {"path": str(tmp_path / "log.jsonl")},
                                            **fields})


def record(log: PayloadLog, request_id: str = "r1", *, model: str = "mlp", inputs: dict | None = None,
           outputs: dict | None = None, error: BaseException | None = None) -> None:
    log.record(model=model, version="2", tenant="team-a", request_id=request_id,
               inputs=inputs if inputs is not None else {"x": X, "secret": X},
               outputs=outputs if outputs is not None or error else {"y": Y}, latency_s=0.0125, error=error)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_by_default_and_sampling_follows_share_and_models(tmp_path):
    assert not PayloadLog(ServerConfig().payload_log).wants("mlp")
    log = PayloadLog(settings(tmp_path, models=["mlp"]))
    try:
        assert log.wants("mlp") and not log.wants("other")
        log.apply(settings(tmp_path, sample=0.0))
        assert not any(log.wants("mlp") for _ in range(1000))
        log.apply(settings(tmp_path, sample=0.25))
        share = sum(log.wants("mlp") for _ in range(20_000)) / 20_000
        assert 0.2 < share < 0.3
    finally:
        log.close()


def test_a_record_holds_the_request_and_answer_with_redaction(tmp_path):
    log = PayloadLog(settings(tmp_path, redact=["secret"]))
    view = X.copy()
    record(log, inputs={"x": view, "secret": X})
    view[:] = -1  # the engine's arrays may be reused buffers: the log kept its own copy
    record(log, "r2", error=Refused("lane full"))
    log.close()
    ok, failed = lines(tmp_path / "log.jsonl")
    assert ok["model"] == "mlp" and ok["version"] == "2" and ok["tenant"] == "team-a" and ok["request_id"] == "r1"
    assert ok["status"] == 200 and ok["error"] is None and ok["latency_ms"] == 12.5
    assert ok["time"].endswith("Z") and ok["time"][:2] == "20"
    assert ok["inputs"]["x"] == {"datatype": "FP32", "shape": [1, 8], "data": list(range(8))}
    assert ok["inputs"]["secret"] == {"datatype": "FP32", "shape": [1, 8], "data": "[redacted]"}
    assert ok["outputs"] == {"y": {"datatype": "FP32", "shape": [1, 2], "data": [0.25, 0.75]}}
    assert failed["status"] == 503 and failed["error"] == {"code": "overloaded", "message": "lane full"}
    assert failed["outputs"] is None
    assert log.counts.records["file", "written"] == 2


def test_digests_instead_of_values_when_asked_or_when_a_tensor_is_large(tmp_path):
    big = np.ones((1, 100), dtype=np.float64)
    log = PayloadLog(settings(tmp_path, max_tensor_bytes=64))
    record(log, inputs={"x": X, "big": big})
    log.apply(settings(tmp_path, content="digests", redact=["x"]))
    record(log, "r2", inputs={"x": X, "words": np.array([b"ab", b"c"], dtype=object)})
    log.close()
    mixed, digests = lines(tmp_path / "log.jsonl")
    assert mixed["inputs"]["x"]["data"] == list(range(8))
    assert mixed["inputs"]["big"] == {"datatype": "FP64", "shape": [1, 100],
                                      "sha256": hashlib.sha256(big.tobytes()).hexdigest()}
    assert digests["inputs"]["x"] == {"datatype": "FP32", "shape": [1, 8], "data": "[redacted]"}  # no digest either
    assert digests["outputs"]["y"]["sha256"] == hashlib.sha256(Y.tobytes()).hexdigest()
    laid_out = b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"  # the OIP binary layout of BYTES
    assert digests["inputs"]["words"] == {"datatype": "BYTES", "shape": [2],
                                          "sha256": hashlib.sha256(laid_out).hexdigest()}


def test_files_rotate_by_size_and_keep_as_many_as_asked(tmp_path):
    path = tmp_path / "log.jsonl"
    log = PayloadLog(settings(tmp_path, file={"path": str(path), "max_bytes": 4096, "keep": 2}))
    for i in range(200):
        record(log, f"r{i}")
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["log.jsonl", "log.jsonl.1", "log.jsonl.2"]
    kept = [line["request_id"] for name in ("log.jsonl.2", "log.jsonl.1", "log.jsonl")
            for line in lines(tmp_path / name)]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())
    assert kept == [f"r{i}" for i in range(200 - len(kept), 200)]  # the newest, in order, none cut
    assert log.counts.records["file", "written"] == 200


def test_a_full_queue_drops_and_counts_and_never_waits(tmp_path):
    log = PayloadLog(settings(tmp_path, queue_records=3))
    started = time.perf_counter()
    for i in range(200):  # the writer lets records gather for 50 ms: all of these arrive meanwhile
        record(log, f"r{i}")
    assert time.perf_counter() - started < 0.05
    log.close()
    written, dropped = log.counts.records["file", "written"], log.counts.records["file", "dropped"]
    assert written == len(lines(tmp_path / "log.jsonl")) and written <= 6
    assert written + dropped == 200 and log.counts.drops["file", "queue_full"] == dropped


def test_the_http_sink_gets_kserve_cloudevents_in_binary_mode(tmp_path):
    receiver = EventReceiver()
    try:
        log = PayloadLog(settings(tmp_path, http={"url": receiver.url, "source": "test-server", "namespace": "ns",
                                                  "headers": {"Authorization": "Bearer s3cret"}}))
        record(log, "r1")
        log.close()
        request, = receiver.of_type("org.kubeflow.serving.inference.request")
        response, = receiver.of_type("org.kubeflow.serving.inference.response")
    finally:
        receiver.close()
    for event in (request, response):
        h = event.headers
        assert h["ce-specversion"] == "1.0" and h["ce-id"] == "r1" and h["ce-source"] == "test-server"
        assert h["ce-inferenceservicename"] == "mlp" and h["ce-endpoint"] == "2" and h["ce-namespace"] == "ns"
        assert h["ce-component"] == "predictor" and h["ce-time"].endswith("Z") and h["ce-tenant"] == "team-a"
        assert h["content-type"] == "application/json" and h["authorization"] == "Bearer s3cret"
    assert request.json()["id"] == "r1"
    assert request.json()["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [1, 8], "data": list(range(8))}
    body = response.json()
    assert body["model_name"] == "mlp" and body["model_version"] == "2" and body["id"] == "r1"
    assert body["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0.25, 0.75]}]
    assert body["parameters"]["status"] == 200
    assert log.counts.records["http", "written"] == 1 and log.counts.records["file", "written"] == 1


def test_the_clients_oip_id_is_kept_beside_the_servers_request_id(tmp_path):
    """The file's record says both ids; the CloudEvents keep the server's as ce-id and carry the
    client's in their OIP bodies, as the client sent it and got it back (issue 45)."""
    receiver = EventReceiver()
    try:
        log = PayloadLog(settings(tmp_path, http={"url": receiver.url, "source": "test-server"}))
        log.record(model="mlp", version="2", tenant=None, request_id="server-1", inputs={"x": X},
                   outputs={"y": Y}, latency_s=0.01, error=None, oip_id="client-1")
        record(log, "server-2")  # no OIP id: the request id stands in the bodies, as before
        log.close()
        requests = receiver.of_type("org.kubeflow.serving.inference.request")
        responses = receiver.of_type("org.kubeflow.serving.inference.response")
    finally:
        receiver.close()
    first, second = lines(tmp_path / "log.jsonl")
    assert (first["request_id"], first["id"]) == ("server-1", "client-1")
    assert (second["request_id"], second["id"]) == ("server-2", None)
    for events in (requests, responses):
        by_ce_id = {event.headers["ce-id"]: event.json()["id"] for event in events}
        assert by_ce_id == {"server-1": "client-1", "server-2": "server-2"}


def test_batch_mode_sends_many_structured_events_per_post(tmp_path):
    receiver = EventReceiver()
    try:
        log = PayloadLog(settings(tmp_path, file=None, http={"url": receiver.url, "mode": "batch"}))
        for i in range(50):
            record(log, f"r{i}")
        log.close()
    finally:
        receiver.close()
    assert len(receiver.posts) < 10
    assert {p.headers["content-type"] for p in receiver.posts} == {"application/cloudevents-batch+json"}
    events = [e for p in receiver.posts for e in p.json()]
    assert len(events) == 100 and {e["specversion"] for e in events} == {"1.0"}
    assert [e["id"] for e in events if e["type"].endswith(".request")] == [f"r{i}" for i in range(50)]
    assert events[1]["data"]["outputs"][0]["data"] == [0.25, 0.75]
    assert log.counts.records["http", "written"] == 50


def test_a_dead_sink_counts_failures(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}/"  # bound, never listening: refused
    log = PayloadLog(settings(tmp_path, http={"url": dead_url, "retries": 0}))
    for i in range(20):
        record(log, f"r{i}")
    log.close()
    counts = log.counts.records
    assert counts["file", "written"] == 20 and counts["http", "written"] == 0
    assert counts["http", "failed"] + counts["http", "dropped"] == 20 and counts["http", "failed"] >= 1


def test_a_stuck_sink_drops_and_counts_without_blocking_record(tmp_path):
    stuck = EventReceiver(delay_s=0.2)  # answers after the sink's timeout: the backlog fills up
    try:
        log = PayloadLog(settings(tmp_path, http={"url": stuck.url, "timeout_s": 0.1, "retries": 0},
                                  queue_records=5))
        slowest = 0.0
        for i in range(100):
            started = time.perf_counter()
            record(log, f"s{i}")
            slowest = max(slowest, time.perf_counter() - started)
            if i % 10 == 0:
                time.sleep(0.06)  # let the writer hand records on to the stuck sink
        log.close(timeout_s=0.3)
    finally:
        stuck.close()
    counts = log.counts.records
    assert slowest < 0.01
    assert counts["http", "written"] + counts["http", "failed"] + counts["http", "dropped"] == 100
    assert log.counts.drops["http", "sink_backlog"] > 0
    assert counts["file", "written"] + counts["file", "dropped"] == 100


def test_a_change_that_cannot_be_applied_keeps_the_running_log(tmp_path):
    log = PayloadLog(settings(tmp_path))
    try:
        with pytest.raises(ValidationError, match="does not exist or is not writable"):
            settings(tmp_path, file={"path": str(tmp_path / "missing" / "log.jsonl")})
        gone = tmp_path / "gone"
        gone.mkdir()
        valid_then = settings(tmp_path, file={"path": str(gone / "log.jsonl")})
        gone.rmdir()  # removed between the check at load and the apply
        with pytest.raises(OSError):
            log.apply(valid_then)
        record(log, "r1")
    finally:
        log.close()
    assert [line["request_id"] for line in lines(tmp_path / "log.jsonl")] == ["r1"]


def test_the_counters_are_exposed_for_every_sink(tmp_path):
    log = PayloadLog(settings(tmp_path))
    record(log, "r1")
    log.close()
    registry = CollectorRegistry()
    registry.register(PayloadLogCollector(log))
    text = generate_latest(registry).decode()
    assert 'servewell_payload_log_records_total{outcome="written",sink="file"} 1.0' in text
    assert 'servewell_payload_log_records_total{outcome="dropped",sink="http"} 0.0' in text
    assert 'servewell_payload_log_drops_total{reason="queue_full",sink="file"} 0.0' in text
    assert 'servewell_payload_log_queue_depth{queue="records"} 0.0' in text


@pytest.mark.parametrize("fields, problem", [
    ({"enabled": True}, "has no sink"),
    ({"http": {"url": "ftp://example.com/"}}, "http:// or https://"),
    ({"http": {"url": "http://x/", "headers": {"ce-id": "1"}}}, "set by the sink"),
    ({"http": {"url": "http://x/", "headers": {"X-Token": "a\r\nb"}}}, "line break"),
    ({"sample": 1.5}, "less than or equal to 1"),
    ({"file": {"path": "/tmp/x", "keep": -1}}, "greater than or equal to 0"),
    ({"unknown": 1}, "Extra inputs"),
])
def test_invalid_settings_are_refused(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        PayloadLogConfig.model_validate(fields)


def test_admin_report_never_shows_the_sink_url_or_headers():
    config = ServerConfig.model_validate({"payload_log": {"http": {"url": "https://user:pw@sink/",
                                                                   "headers": {"Authorization": "Bearer s3cret"}}}})
    dumped = json.dumps(config.model_dump(mode="json"))
    assert "s3cret" not in dumped and "pw@" not in dumped


def test_record_never_raises(tmp_path):
    log = PayloadLog(settings(tmp_path))
    try:
        log.record(model="mlp", version="1", tenant=None, request_id="r", inputs={"x": object()},
                   outputs=None, latency_s=0.0, error=None)
        record(log, "r2")
    finally:
        log.close()
    assert [line["request_id"] for line in lines(tmp_path / "log.jsonl")] == ["r2"]  # the next one is logged


def test_the_dashboard_shows_every_payload_log_family():
    from monitoring import METRIC_NAME, PAYLOAD_LOG_FAMILIES, panels

    shown = {name for panel in panels() for target in panel["targets"] for name in METRIC_NAME.findall(target["expr"])}
    assert set(PAYLOAD_LOG_FAMILIES) <= shown


# ---------- a failing sink, and who may read the files (issue 45, H8 and H12) ----------

def test_files_are_created_for_the_servers_user_only(tmp_path):
    # They were created 0644 under the usual umask: every local user could read the clients' payloads.
    log = PayloadLog(settings(tmp_path, file={"path": str(tmp_path / "log.jsonl"), "max_bytes": 4096, "keep": 2}))
    for i in range(40):  # about 300 bytes a line: the file rotates a few times
        record(log, f"r{i}")
    log.close()
    files = sorted(tmp_path.glob("log.jsonl*"))
    assert [f.name for f in files] == ["log.jsonl", "log.jsonl.1", "log.jsonl.2"]
    assert {f.stat().st_mode & 0o777 for f in files} == {0o600}


def test_a_full_disk_warns_once_and_shows_the_failing_sink(tmp_path, caplog):
    full = tmp_path / "full.jsonl"
    full.symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    log = PayloadLog(settings(tmp_path, file={"path": str(full)}))
    caplog.set_level("WARNING", logger="servewell.payload_log")
    try:
        for i in range(4):  # one record a batch: each waits until the one before has failed
            record(log, f"r{i}")
            eventually(lambda n=i + 1: log.counts.records["file", "failed"] == n, 5, "the write failed", 0.01)
        health = log.health()
    finally:
        log.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings  # four batches failed; it once warned for each
    assert "file sink" in warnings[0] and "ENOSPC" in warnings[0] and "once a minute" in warnings[0]
    assert health == {"enabled": True, "status": "failing", "sinks": {"file": {
        "failing": True, "since": health["sinks"]["file"]["since"], "problem": "ENOSPC: No space left on device",
        "failed_records": 4}}}
    registry = CollectorRegistry()
    registry.register(PayloadLogCollector(log))
    text = generate_latest(registry).decode()
    assert 'servewell_payload_log_sink_failing{sink="file"} 1.0' in text
    assert 'servewell_payload_log_sink_failing{sink="http"} 0.0' in text


def test_sink_health_warns_at_most_once_a_minute_and_when_it_writes_again(caplog):
    now = [1000.0]
    health = SinkHealth("file", clock=lambda: now[0], wall_clock=lambda: 1.7e9)
    caplog.set_level("INFO", logger="servewell.payload_log")
    health.succeeded("/var/log/p.jsonl")  # working: nothing to say
    for _ in range(3):
        health.failed("ENOSPC: No space left on device", 10, "/var/log/p.jsonl")
        now[0] += 20.0
    assert health.to_json() == {"failing": True, "since": 1.7e9, "problem": "ENOSPC: No space left on device",
                                "failed_records": 30}
    health.failed("ENOSPC: No space left on device", 5, "/var/log/p.jsonl")  # 60 s after the first warning
    health.succeeded("/var/log/p.jsonl")
    assert health.to_json()["failing"] is False
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "failed: ENOSPC" in messages[0]
    assert "still fails" in messages[1] and "25 records failed since the last warning" in messages[1]
    assert "writes again, after 35 records failed" in messages[2]
    health.failed("EIO: Input/output error", 1, "/var/log/p.jsonl")  # a new spell warns at once
    assert len(caplog.records) == 4 and "failed: EIO" in caplog.records[-1].getMessage()


def test_a_failing_http_sink_is_shown_and_its_url_never(tmp_path, caplog):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}/secret-path?token=s3cret"
    log = PayloadLog(settings(tmp_path, http={"url": dead_url, "retries": 0}))
    caplog.set_level("WARNING", logger="servewell.payload_log")
    try:
        record(log, "r1")
        eventually(lambda: log.health()["sinks"]["http"]["failing"], 5, "the http sink failing")
        health = log.health()
    finally:
        log.close()
    assert health["status"] == "failing" and not health["sinks"]["file"]["failing"]
    assert health["sinks"]["http"]["problem"] == "ECONNREFUSED: Connection refused"
    assert "s3cret" not in caplog.text and "secret-path" not in caplog.text and "s3cret" not in str(health)
