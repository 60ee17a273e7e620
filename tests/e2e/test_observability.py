"""Headers, JSON logs, metric values after known traffic, and trace spans with their links,
received by an in-test OTLP/HTTP collector and decoded with the official protobuf messages."""

from __future__ import annotations

import asyncio
import json
import socket
import textwrap
import time

import httpx
import pytest
import torch
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from model_dirs import infer_body as body
from otlp_collector import Collector
from waiting import eventually

STEPPED = textwrap.dedent('''
    import torch
    from torch import nn

    from servewell import trace_step


    class Stepped(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            with trace_step("custom_post"):
                return x * self.scale


    def build():
        return Stepped()
''')

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def stepped_model(root) -> None:
    directory = root / "stepped"
    directory.mkdir()
    (directory / "stepped_factory.py").write_text(STEPPED)
    save_file({"scale": torch.ones(1)}, str(directory / "model.safetensors"))
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors", "pytorch": {"factory": "stepped_factory:build"},
        "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    }))


@pytest.fixture(scope="module")
def traced(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("traced")
    stepped_model(root)
    collector = Collector()
    # Every request is slow here, and each test reads its own request's slow line: none summed up.
    server = start_module_server(["--model-repository", str(root), "--slow-request-ms", "0.001",
                                  "--slow-request-lines-per-model", "10000"],
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_TRACES_SAMPLER_ARG": "1.0"})
    server.wait_ready()
    yield server, collector
    collector.close()


def infer(url: str, value: float, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v2/models/stepped/infer", json=body(value), headers=headers or {}, timeout=30)


def test_server_timing_and_process_time_headers(traced):
    server, _ = traced
    r = infer(server.url, 1.0)
    timing = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    assert set(timing) == {"preprocess", "queue", "compute", "postprocess", "total"}
    assert all(float(v) >= 0 for v in timing.values())
    assert float(timing["total"]) >= float(timing["compute"])
    assert float(r.headers["x-process-time"]) > 0


def test_spans_http_queue_preprocess_batch_with_links_and_compute_in_the_worker(traced):
    server, collector = traced

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return await asyncio.gather(
                c.post("/v2/models/stepped/infer", json=body(7.0), headers={"traceparent": TRACEPARENT,
                                                                              "X-Request-ID": "traced-req"}),
                *(c.post("/v2/models/stepped/infer", json=body(float(i))) for i in range(5)),
            )

    assert all(r.status_code == 200 for r in asyncio.run(burst()))

    def exported() -> list | None:
        mine = [s for s in collector.named("http") if s.trace_id.hex() == TRACEPARENT[3:35]]
        return mine if mine and collector.named("compute") and collector.named("custom_post") else None

    http = eventually(exported, 20, "the request's http, compute and custom_post spans were not exported")[0]
    assert http.parent_span_id.hex() == TRACEPARENT[36:52]  # continued the caller's trace
    attributes = {a.key: a.value.string_value or a.value.int_value for a in http.attributes}
    assert attributes["http.route"] == "/v2/models/{name}/infer" and attributes["servewell.model"] == "stepped"
    by_id = {s.span_id: s for s in collector.spans}

    def descends_from_http(span) -> bool:
        while span.parent_span_id:
            if span.parent_span_id == http.span_id:
                return True
            span = by_id.get(span.parent_span_id)
            if span is None:
                return False
        return False

    inside = {s.name for s in collector.spans if descends_from_http(s)}
    assert {"queue", "preprocess"} <= inside
    batch = next(s for s in collector.named("batch") if any(link.span_id == http.span_id for link in s.links))
    batch_attributes = {a.key: a.value.int_value for a in batch.attributes if a.value.HasField("int_value")}
    assert batch_attributes["servewell.batch_size"] >= 1
    # The request span names its batch (the same id as the batch span), the batch's size, the
    # worker instance and the request's place in its lane.
    assert attributes["servewell.batch.id"] == batch_attributes["servewell.batch.id"]
    assert attributes["servewell.batch.size"] == batch_attributes["servewell.batch_size"]
    assert attributes["servewell.worker.instance"] == 0 and attributes["servewell.queue.position"] >= 0
    compute = [s for s in collector.named("compute") if s.parent_span_id == batch.span_id]
    assert compute and compute[0].trace_id == batch.trace_id  # the context crossed into the worker
    steps = [s for s in collector.named("custom_post") if s.parent_span_id == compute[0].span_id]
    assert steps, "trace_step inside model code is a child of compute"


def test_json_logs_carry_ids_and_never_payloads(traced):
    server, _ = traced
    infer(server.url, 3.0, headers={"X-Request-ID": "log-me-1", "traceparent": TRACEPARENT})
    bad = httpx.post(server.url + "/v2/models/stepped/infer", headers={"X-Request-ID": "bad-one-1"},
                     json={"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0.5, 987654.25]}]})
    assert bad.status_code == 422

    def logged() -> list[dict] | None:
        events = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        ids = {e.get("request_id") for e in events}
        return events if {"log-me-1", "bad-one-1"} <= ids else None

    events = eventually(logged, 10, "the slow and the failed request were not logged")
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in events)
    slow = [e for e in events if e.get("request_id") == "log-me-1" and e["message"].startswith("slow request")]
    assert slow and set(slow[0]["stages_ms"]) == {"preprocess", "queue", "compute", "postprocess"}
    assert isinstance(slow[0]["batch_id"], int) and slow[0]["batch_size"] >= 1  # where it ran
    assert slow[0]["instance"] == 0 and slow[0]["queue_position"] >= 0
    assert slow[0]["trace_id"] == TRACEPARENT[3:35] and len(slow[0]["span_id"]) == 16
    failed = [e for e in events if e.get("request_id") == "bad-one-1" and e.get("code") == "invalid_input"]
    assert len(failed) == 1 and failed[0]["status"] == 422 and failed[0].get("model") == "stepped"
    assert "987654" not in server.log()


UNSAMPLED = "00-1bf7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"


def test_sampling_follows_the_caller_and_records_nothing_for_unsampled_requests(tmp_path, start_server):
    stepped_model(tmp_path)
    collector = Collector()
    server = start_server(["--model-repository", str(tmp_path), "--slow-request-ms", "0.001",
                           "--slow-request-lines-per-model", "10000"],  # the last request's own slow line is read
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_TRACES_SAMPLER_ARG": "1e-9",
                               "OTEL_BSP_SCHEDULE_DELAY": "100"})
    server.wait_ready()
    try:
        for i in range(60):  # no traceparent: recorded at the ratio, here never (at 0.01, 45% would show one)
            assert infer(server.url, float(i)).status_code == 200
        unsampled = infer(server.url, 1.0, headers={"traceparent": UNSAMPLED, "X-Request-ID": "not-sampled"})
        assert unsampled.status_code == 200
        assert infer(server.url, 2.0, headers={"traceparent": TRACEPARENT}).status_code == 200  # sampled by the caller
        eventually(lambda: collector.named("custom_post"), 20, "the sampled request's spans were not exported")
        time.sleep(0.5)  # anything else queued for export (it must not be) would arrive by now
        assert {s.trace_id.hex() for s in collector.spans} == {TRACEPARENT[3:35]}
        assert {s.name for s in collector.spans} >= {"http", "queue", "preprocess", "batch", "compute", "custom_post"}
        assert len(collector.named("http")) == 1 and len(collector.named("custom_post")) == 1
        events = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        carried = [e for e in events if e.get("request_id") == "not-sampled"]
        assert carried and carried[0]["trace_id"] == UNSAMPLED[3:35]  # the caller's trace id reaches the log
    finally:
        collector.close()


def metric_samples(url: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metric_families_and_values_after_known_traffic(traced):
    server, _ = traced
    before = metric_samples(server.url)
    for i in range(5):
        assert infer(server.url, float(i)).status_code == 200
    httpx.post(server.url + "/v2/models/stepped/infer", json={"inputs": [{"name": "nope", "shape": [1, 1],
                                                                            "datatype": "FP32", "data": [1]}]})
    after = metric_samples(server.url)
    ok = dict(model="stepped", lane="normal", outcome="success")
    assert value(after, "servewell_requests_total", **ok) - value(before, "servewell_requests_total", **ok) == 5
    route = dict(model="stepped", route="/v2/models/{name}/infer")
    count = "servewell_request_duration_seconds_count"
    assert value(after, count, **route, status_class="2xx") - value(before, count, **route, status_class="2xx") == 5
    assert value(after, count, **route, status_class="4xx") - value(before, count, **route, status_class="4xx") == 1
    for family in ("servewell_queue_wait_seconds_count", "servewell_batch_compute_seconds_count",
                   "servewell_batch_size_count", "servewell_preprocess_seconds_count",
                   "servewell_postprocess_seconds_count", "servewell_batch_transport_seconds_count"):
        assert any(k[0] == family and v > 0 for k, v in after.items()), family
    assert value(after, "servewell_trace_step_seconds_count", step="custom_post") >= 5
    assert value(after, "servewell_model_state", model="stepped", state="ready") == 1
    assert value(after, "servewell_worker_up", model="stepped", worker="0") == 1
    assert value(after, "servewell_worker_resident_memory_bytes", model="stepped", worker="0") > 50e6
    assert value(after, "servewell_worker_private_memory_bytes", model="stepped", worker="0") > 10e6
    assert value(after, "servewell_worker_threads", model="stepped", worker="0") >= 1
    assert value(after, "servewell_model_loads_total", model="stepped", result="success") == 1
    assert not any(k[0].startswith("servewell_gpu_") for k in after)  # no GPU here: absent, not zero
    assert not any("request_id" in dict(k[1]) for k in after)  # no high-cardinality labels


def test_frontend_process_and_garbage_collector_metrics(traced):
    """The frontend's own CPU, memory and collections are exposed, and its garbage collector stays
    off the request path: with CPython's default young-generation threshold (700) and nothing
    frozen, the same 300 traced requests ran 33 young collections and a full one (measured)."""
    server, _ = traced

    async def load():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            for start in range(0, 300, 30):
                answers = await asyncio.gather(*(c.post("/v2/models/stepped/infer", json=body(float(i)))
                                                 for i in range(start, start + 30)))
                assert [r.status_code for r in answers] == [200] * 30

    before = metric_samples(server.url)
    asyncio.run(load())
    after = metric_samples(server.url)
    assert value(after, "process_cpu_seconds_total") > 0 and value(after, "process_resident_memory_bytes") > 10e6
    young = "python_gc_collections_total"
    assert value(after, young, generation="0") - value(before, young, generation="0") < 15
    assert value(after, young, generation="2") - value(before, young, generation="2") == 0


def test_otlp_grpc_export_from_frontend_and_worker(tmp_path, start_server):
    """The same spans over OTLP/gRPC (`OTEL_EXPORTER_OTLP_PROTOCOL=grpc`), received by an in-test
    gRPC TraceService."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list = []

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    received.extend(scope_spans.spans)
            return ExportTraceServiceResponse()

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        stepped_model(tmp_path)
        server = start_server(["--model-repository", str(tmp_path)],
                              env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER_ARG": "1.0",
                                   "OTEL_BSP_SCHEDULE_DELAY": "100"})
        server.wait_ready()
        assert infer(server.url, 1.0, headers={"traceparent": TRACEPARENT}).status_code == 200
        wanted = {"http", "queue", "preprocess", "batch", "compute", "custom_post"}
        eventually(lambda: wanted <= {s.name for s in received}, 20,
                   lambda: f"spans received over gRPC: {sorted({s.name for s in received})}, wanted {sorted(wanted)}")
        assert {s.trace_id.hex() for s in received} == {TRACEPARENT[3:35]}
    finally:
        grpc_server.stop(0)


def test_unreachable_collector_changes_nothing_for_clients(tmp_path, start_server):
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(1)  # accepts nothing: exports hang until their timeout
    stepped_model(tmp_path)
    server = start_server(["--model-repository", str(tmp_path)],
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{blackhole.getsockname()[1]}"})
    server.wait_ready()

    async def load():
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            return await asyncio.gather(*(c.post("/v2/models/stepped/infer", json=body(float(i))) for i in range(200)))

    answers = asyncio.run(load())
    assert [r.status_code for r in answers] == [200] * 200
    blackhole.close()


def test_profile_endpoint_returns_a_chrome_trace_of_the_worker(traced):
    server, _ = traced

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            capture = asyncio.create_task(c.post("/admin/models/stepped/profile", params={"seconds": 1.0}))
            await asyncio.sleep(0.2)
            for i in range(5):
                assert (await c.post("/v2/models/stepped/infer", json=body(float(i)))).status_code == 200
            return await capture

    r = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert "attachment" in r.headers["content-disposition"]
    events = r.json()["traceEvents"]
    assert any("aten::mul" in str(e.get("name", "")) for e in events)  # the model's own op
    bad = httpx.post(server.url + "/admin/models/stepped/profile", params={"seconds": 0})
    assert bad.status_code == 422
