"""The client's OIP request `id` is echoed by every way into a model (a traffic split, a shadowed
model, a pipeline, a cache hit, a cold load in lazy mode), over HTTP and gRPC; the payload log and
its CloudEvents carry it beside the server's request id; and an error answered by a version a
traffic split drew says which version, as a success does (issue 45: one trial of a split model saw
no `id`; H10 / W11: a split's error answers carried no X-Model-Version)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from error_bodies import error_of
from event_receiver import EventReceiver
from servers import ServerFactory, ServerProcess
from waiting import eventually

SCALER = textwrap.dedent('''
    import numpy as np


    class Scaler:
        """y = x * factor; refuses the value 13 (a model error, answered by the version that ran)."""

        def setup(self, config):
            self.factor = config["settings"].get("factor", 1.0)

        def execute(self, inputs):
            x = inputs["x"]
            if (x == 13).any():
                raise ValueError("refusing 13")
            return {"y": (x * self.factor).astype(np.float32)}
''')
TENSORS = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
           "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}


def scaler(directory: Path, version: str = "1", factor: float = 2.0, **fields: Any) -> None:
    directory.mkdir(parents=True)
    (directory / "scaler.py").write_text(SCALER)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "version": version, "runtime": "python", "artifact": "scaler.py",
        "python": {"entry": "scaler:Scaler", "settings": {"factor": factor}}, **TENSORS, "max_batch_size": 4,
        "warmup": False, **fields,
    }))


def repository(root: Path) -> Path:
    scaler(root / "split", traffic={"1": 50, "2": 50}, rollout={"sticky": "none"})
    scaler(root / "split" / "versions" / "2", "2", factor=3.0)
    scaler(root / "shadowed", rollout={"shadow": {"version": "2", "percent": 100}})
    scaler(root / "shadowed" / "versions" / "2", "2", factor=3.0)
    scaler(root / "cached", cache={"max_bytes": 1 << 20, "ttl_s": 600})
    scaler(root / "plain")
    (root / "chain").mkdir()
    (root / "chain" / "model.yaml").write_text(yaml.safe_dump({
        "kind": "pipeline", "max_batch_size": 1, **TENSORS,
        "pipeline": {"steps": [{"name": "first", "model": "plain", "inputs": {"x": "x"}}], "outputs": {"y": "first.y"}},
    }))
    return root


@pytest.fixture(scope="module")
def receiver() -> Iterator[EventReceiver]:
    started = EventReceiver()
    yield started
    started.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory,
           receiver: EventReceiver) -> ServerProcess:
    root = repository(tmp_path_factory.mktemp("ids-repo"))
    conf = tmp_path_factory.mktemp("ids-conf")
    (conf / "server.yaml").write_text(yaml.safe_dump({"payload_log": {
        "enabled": True, "models": ["split", "cached"], "file": {"path": str(conf / "payload.jsonl")},
        "http": {"url": receiver.url, "source": "e2e"}}}))
    started = start_module_server(["--model-repository", str(root), "--config", str(conf / "server.yaml"),
                                   "--config-poll-s", "0"])
    started.wait_ready()
    started.conf = conf  # type: ignore[attr-defined]
    eventually(lambda: all(v["state"] == "ready" for name in ("split", "shadowed")
                           for v in httpx.get(f"{started.url}/admin/models/{name}/rollout", timeout=10)
                           .json()["versions"].values()), 120, "the other versions loaded")
    return started


def http_infer(server: ServerProcess, model: str, value: float, oip_id: str,
               request_id: str | None = None) -> httpx.Response:
    body = {"id": oip_id, "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    headers = {"X-Request-ID": request_id} if request_id else {}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, headers=headers, timeout=60)


def grpc_infer(server: ServerProcess, model: str, value: float, oip_id: str) -> tuple[pb.ModelInferResponse, Any]:
    request = pb.ModelInferRequest(model_name=model, id=oip_id)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[value]], np.float32).tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        response, call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(request, timeout=60)
    return response, call


def echoes(server: ServerProcess, model: str, label: str, value: float = 1.0) -> set[str]:
    """Three requests over HTTP and three over gRPC, each with its own id, each echoed; the versions
    that answered."""
    versions = set()
    for n in range(3):
        answer = http_infer(server, model, value, f"{label}-http-{n}")
        assert answer.status_code == 200, answer.text
        assert answer.json()["id"] == f"{label}-http-{n}", answer.json()
        versions.add(answer.headers["x-model-version"])
        response, _ = grpc_infer(server, model, value, f"{label}-grpc-{n}")
        assert response.id == f"{label}-grpc-{n}"
    return versions


@pytest.mark.parametrize("model", ["split", "shadowed", "chain", "plain"])
def test_every_way_into_a_model_echoes_the_clients_id(server: ServerProcess, model: str) -> None:
    versions = echoes(server, model, model, value=float(len(model)))
    if model == "split":
        for n in range(20):  # both versions of the split answer, each echoing the id
            versions |= echoes(server, model, f"split-more-{n}") if len(versions) < 2 else set()
        assert versions == {"1", "2"}


def test_a_cache_hit_echoes_its_own_id_not_the_one_that_filled_the_cache(server: ServerProcess) -> None:
    first = http_infer(server, "cached", 5.0, "fills-the-cache")
    assert first.status_code == 200 and first.json()["id"] == "fills-the-cache"
    hit = http_infer(server, "cached", 5.0, "hits-the-cache")
    assert "cache;desc=hit" in hit.headers["server-timing"], hit.headers
    assert hit.json()["id"] == "hits-the-cache"
    response, call = grpc_infer(server, "cached", 5.0, "hits-over-grpc")
    assert response.id == "hits-over-grpc"
    assert "cache;desc=hit" in dict(call.trailing_metadata())["server-timing"]


def test_a_split_versions_error_says_which_version_answered(server: ServerProcess) -> None:
    seen: set[str] = set()
    for n in range(30):
        answer = http_infer(server, "split", 13.0, f"bad-{n}")
        assert answer.status_code == 500, answer.text
        assert error_of(answer)["code"] == "model_error"
        seen.add(answer.headers["x-model-version"])
        if seen == {"1", "2"}:
            break
    assert seen == {"1", "2"}
    with pytest.raises(grpc.RpcError) as failed:
        grpc_infer(server, "split", 13.0, "bad-grpc")
    call: Any = failed.value  # a grpc.Call too, which RpcError's stubs do not say
    trailers: dict[str, Any] = dict(call.trailing_metadata())
    assert trailers["servewell-error-code"] == "model_error" and trailers["x-model-version"] in ("1", "2")


def test_the_payload_log_and_its_cloudevents_carry_the_clients_id_beside_the_servers(
        server: ServerProcess, receiver: EventReceiver) -> None:
    answer = http_infer(server, "split", 7.0, "client-chosen-7", request_id="server-side-7")
    assert answer.status_code == 200
    log_path: Path = server.conf / "payload.jsonl"  # type: ignore[attr-defined]

    def record() -> dict[str, Any] | None:
        lines = log_path.read_text().splitlines() if log_path.exists() else []
        found = [json.loads(line) for line in lines if json.loads(line)["request_id"] == "server-side-7"]
        return found[0] if found else None

    logged = eventually(record, 20, "the request's payload record")
    assert logged["id"] == "client-chosen-7" and logged["request_id"] == "server-side-7"
    events = eventually(lambda: [p for p in receiver.posts if p.headers.get("ce-id") == "server-side-7"] or None,
                        20, "the request's CloudEvents")
    assert {json.loads(p.body)["id"] for p in events} == {"client-chosen-7"}  # request and response bodies


@pytest.fixture(scope="module")
def lazy_server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("ids-lazy")
    scaler(root / "cold")
    scaler(root / "colder")
    started = start_module_server(["--model-repository", str(root), "--repository-mode", "lazy",
                                   "--config-poll-s", "0"])
    started.wait_live()
    return started


def test_a_request_that_loads_its_model_echoes_the_clients_id(lazy_server: ServerProcess) -> None:
    answer = http_infer(lazy_server, "cold", 2.0, "loads-it-http")
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "loads-it-http"
    response, _ = grpc_infer(lazy_server, "colder", 2.0, "loads-it-grpc")
    assert response.id == "loads-it-grpc"
    health = httpx.get(f"{lazy_server.url}/healthz", timeout=10).json()["models"]
    assert health["cold"]["cold_starts"] >= 1 and health["colder"]["cold_starts"] >= 1
