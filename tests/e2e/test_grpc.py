"""OIP v2 over gRPC, driven with `tritonclient.grpc` (sync and asyncio) as a Triton user would."""

from __future__ import annotations

import asyncio
import io

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from google.protobuf import json_format  # type: ignore[import-untyped]  # no stubs installed
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from model_dirs import infer_body, onnx_mlp_model, slow_model, torchscript_mlp_model
from servewell.examples.digits import DIGITS_PREPROCESS, load_split, render_digit
from servewell.imaging import transform_image


@pytest.fixture(scope="module")
def client(digits_server):
    with triton.InferenceServerClient(digits_server.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("grpc-slow")
    slow_model(root, "slow", 100, max_batch_size=4)
    slow_model(root, "one_at_a_time", 200, max_batch_size=1)
    onnx_mlp_model(root, "tiny_onnx", metadata={"team": "vision"})
    torchscript_mlp_model(root, "tiny_ts", max_batch_size=0, batching={"policy": "window", "max_wait_ms": 2})
    server = start_module_server(["--model-repository", str(root), "--admin-token", "s3cret"])
    server.wait_ready()
    return server


def tensor(name: str, array: np.ndarray, datatype: str = "FP32") -> triton.InferInput:
    t = triton.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def status_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def rows_computed(url: str, model: str) -> int:
    health = httpx.get(url + "/healthz").json()
    return sum(i["rows_computed"] for i in health["models"][model]["instances"])


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits")
    with pytest.raises(InferenceServerException) as unknown_version:
        client.is_model_ready("digits", "7")
    assert status_of(unknown_version.value) == "StatusCode.NOT_FOUND"
    server = client.get_server_metadata()
    assert server.name == "servewell" and "model_repository" in server.extensions
    meta = client.get_model_metadata("digits")
    assert meta.name == "digits" and meta.versions == ["1"]
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [("input", "FP32", [-1, 1, 8, 8])]
    assert meta.outputs[0].name == "logits"
    config = client.get_model_config("digits").config
    assert config.name == "digits" and config.max_batch_size > 0 and config.input[0].name == "input"
    index = client.get_model_repository_index()
    assert [(m.name, m.state) for m in index.models] == [("digits", "READY")]


def test_accuracy_through_grpc_tensors(client):
    _, x_test, _, y_test = load_split()
    images = np.stack([transform_image(render_digit(x), DIGITS_PREPROCESS) for x in x_test]).astype(np.float32)
    predicted = []
    for start in range(0, len(images), 32):
        chunk = images[start : start + 32]
        result = client.infer("digits", [tensor("input", chunk)], request_id=f"chunk-{start}")
        assert result.get_response().id == f"chunk-{start}"
        logits = result.as_numpy("logits")
        assert logits.shape == (len(chunk), 10)
        predicted.extend(logits.argmax(1))
    accuracy = float((np.array(predicted) == y_test).mean())
    assert accuracy >= 0.95, accuracy


def test_accuracy_through_grpc_encoded_images_asyncio(digits_server):
    _, x_test, _, y_test = load_split()
    x_test, y_test = x_test[:96], y_test[:96]

    def png(x8x8: np.ndarray) -> bytes:
        buf = io.BytesIO()
        render_digit(x8x8, 64).save(buf, format="PNG")
        return buf.getvalue()

    async def main() -> list[int]:
        async with triton_aio.InferenceServerClient(digits_server.grpc_url) as aio:
            assert await aio.is_server_ready()
            assert (await aio.get_model_metadata("digits")).name == "digits"

            gate = asyncio.Semaphore(16)  # more at once would meet the decode queue's bound (503, by design)

            async def one(x: np.ndarray) -> int:
                async with gate:
                    result = await aio.infer("digits", [tensor("input", np.array([png(x)], dtype=object), "BYTES")])
                return int(result.as_numpy("logits").argmax(1)[0])

            return await asyncio.gather(*(one(x) for x in x_test))

    predicted = asyncio.run(main())
    accuracy = float((np.array(predicted) == y_test).mean())
    assert accuracy >= 0.95, accuracy


def test_typed_contents_are_accepted(digits_server):
    """tritonclient sends raw contents; other clients (KServe's) send typed ones."""
    image = transform_image(render_digit(load_split()[1][0]), DIGITS_PREPROCESS).astype(np.float32)[None]
    request = pb.ModelInferRequest(model_name="digits", id="typed")
    request.inputs.add(name="input", datatype="FP32", shape=list(image.shape)).contents.fp32_contents.extend(
        image.ravel().tolist())
    with grpc.insecure_channel(digits_server.grpc_url) as channel:
        response, call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(request)
    assert response.id == "typed" and response.outputs[0].name == "logits"
    logits = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(1, 10)
    assert np.isfinite(logits).all()
    trailing = dict(call.trailing_metadata())
    assert trailing["x-request-id"] and "compute;dur=" in trailing["server-timing"]


def test_errors_map_to_grpc_status_codes(client, digits_server):
    x = np.zeros((1, 1, 8, 8), dtype=np.float32)
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("nope", [tensor("input", x)])
    assert status_of(unknown.value) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as wrong_name:
        client.infer("digits", [tensor("pixels", x)])
    assert status_of(wrong_name.value) == "StatusCode.INVALID_ARGUMENT" and "pixels" in wrong_name.value.message()
    with pytest.raises(InferenceServerException) as wrong_shape:
        client.infer("digits", [tensor("input", np.zeros((1, 3, 8, 8), dtype=np.float32))])
    assert status_of(wrong_shape.value) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as wrong_type:
        client.infer("digits", [tensor("input", x.astype(np.int32), "INT32")])
    assert status_of(wrong_type.value) == "StatusCode.INVALID_ARGUMENT"
    # The stable servewell code travels in the trailing metadata.
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
    request.raw_input_contents.append(b"\0" * 12)  # too few bytes for the shape
    with grpc.insecure_channel(digits_server.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as bad:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(bad.value.trailing_metadata())["servewell-error-code"] == "invalid_input"
    assert client.is_server_live()  # and the server keeps serving


def test_priority_overtakes_a_full_normal_queue(slow_server):
    async def main() -> list[str]:
        order: list[str] = []
        async with triton_aio.InferenceServerClient(slow_server.grpc_url) as aio:
            async def send(tag: str, value: float, priority: int = 0) -> None:
                result = await aio.infer("slow", [tensor("x", np.array([[value]], dtype=np.float32))],
                                         priority=priority)
                assert result.as_numpy("y")[0, 0] == value
                order.append(tag)

            normal = [asyncio.create_task(send(f"n{i}", i)) for i in range(24)]
            async with httpx.AsyncClient(base_url=slow_server.url) as http:
                while (await http.get("/healthz")).json()["models"]["slow"]["queue_depth"] < 12:
                    await asyncio.sleep(0.01)
            await asyncio.gather(asyncio.create_task(send("urgent", 99.0, priority=1)), *normal)
        return order

    order = asyncio.run(main())
    assert order.index("urgent") <= 8, order  # 24 normal requests make 6 batches of 4


def test_deadlines_from_the_timeout_parameter_and_the_grpc_deadline(slow_server):
    before = rows_computed(slow_server.url, "one_at_a_time")

    async def main() -> tuple[str, str]:
        async with triton_aio.InferenceServerClient(slow_server.grpc_url) as aio:
            x = [tensor("x", np.array([[1.0]], dtype=np.float32))]
            first = asyncio.create_task(aio.infer("one_at_a_time", x))
            await asyncio.sleep(0.05)
            with pytest.raises(InferenceServerException) as by_parameter:
                await aio.infer("one_at_a_time", x, timeout=30_000)  # Triton's timeout: microseconds
            with pytest.raises(InferenceServerException) as by_deadline:
                await aio.infer("one_at_a_time", x, client_timeout=0.03)  # the gRPC deadline
            await first
            return status_of(by_parameter.value), status_of(by_deadline.value)

    by_parameter, by_deadline = asyncio.run(main())
    assert by_parameter == "StatusCode.DEADLINE_EXCEEDED" and by_deadline == "StatusCode.DEADLINE_EXCEEDED"
    assert rows_computed(slow_server.url, "one_at_a_time") - before == 1  # neither expired request ran


def test_a_cancelled_call_is_dropped_before_compute(slow_server):
    before = rows_computed(slow_server.url, "one_at_a_time")
    health = httpx.get(slow_server.url + "/healthz").json()
    cancelled_before = health["models"]["one_at_a_time"]["scheduler"]["cancelled"]

    async def main() -> None:
        request = pb.ModelInferRequest(model_name="one_at_a_time")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(np.array([[1.0]], dtype=np.float32).tobytes())
        async with grpc.aio.insecure_channel(slow_server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            first = stub.ModelInfer(request)
            await asyncio.sleep(0.05)
            doomed = stub.ModelInfer(request)
            await asyncio.sleep(0.05)  # queued behind the first
            doomed.cancel()
            await first
            await asyncio.sleep(0.3)  # the cancelled request would have run by now

    asyncio.run(main())
    assert rows_computed(slow_server.url, "one_at_a_time") - before == 1
    cancelled = httpx.get(slow_server.url + "/healthz").json()["models"]["one_at_a_time"]["scheduler"]["cancelled"]
    assert cancelled == cancelled_before + 1


def test_repository_load_and_unload_need_the_admin_token(slow_server):
    with triton.InferenceServerClient(slow_server.grpc_url) as c:
        with pytest.raises(InferenceServerException) as refused:
            c.unload_model("slow")
        assert status_of(refused.value) == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException):
            c.unload_model("slow", headers={"authorization": "Bearer wrong"})
        assert c.is_model_ready("slow")
        admin = {"authorization": "Bearer s3cret"}
        c.unload_model("slow", headers=admin)
        assert not c.is_model_ready("slow")
        c.load_model("slow", headers=admin)
        assert c.is_model_ready("slow")
        result = c.infer("slow", [tensor("x", np.array([[3.0]], dtype=np.float32))])
        assert result.as_numpy("y")[0, 0] == 3.0


def test_a_grpc_admin_call_forwarded_by_a_proxy_is_not_a_loopback_admin(client):
    # digits_server has no admin token: loopback callers are admin, unless a proxy forwarded them
    # (a proxy on this host connects from 127.0.0.1 for anyone; issue 19.5).
    for proxy_metadata in ({"x-forwarded-for": "203.0.113.7"}, {"forwarded": "for=127.0.0.1"}, {"via": "1.1 envoy"}):
        with pytest.raises(InferenceServerException) as refused:
            client.unload_model("digits", headers=proxy_metadata)
        assert status_of(refused.value) == "StatusCode.PERMISSION_DENIED", proxy_metadata
    assert client.is_model_ready("digits")


def test_grpc_requests_are_in_the_metrics(digits_server, client):
    client.infer("digits", [tensor("input", np.zeros((1, 1, 8, 8), dtype=np.float32))])
    text = httpx.get(digits_server.url + "/metrics").text
    assert 'route="grpc ModelInfer"' in text and 'model="digits"' in text


def test_an_input_given_twice_is_refused_naming_it(client):
    x = np.zeros((1, 1, 8, 8), dtype=np.float32)
    with pytest.raises(InferenceServerException) as twice:
        client.infer("digits", [tensor("input", x), tensor("input", x + 1)])
    assert status_of(twice.value) == "StatusCode.INVALID_ARGUMENT"
    assert "'input' is given more than once" in twice.value.message()


#: One model of each runtime in `slow_server`, with the Triton platform both ports must name.
PLATFORM_OF = {"tiny_onnx": "onnxruntime_onnx", "tiny_ts": "pytorch_libtorch", "slow": "pytorch"}


@pytest.mark.parametrize("model", sorted(PLATFORM_OF))
def test_http_and_grpc_tell_the_same_model_config_and_metadata(slow_server, model):
    with triton.InferenceServerClient(slow_server.grpc_url) as c:
        grpc_config = c.get_model_config(model).config
        grpc_meta = c.get_model_metadata(model)
    http_config = httpx.get(f"{slow_server.url}/v2/models/{model}/config").json()
    http_meta = httpx.get(f"{slow_server.url}/v2/models/{model}").json()
    # Parsed strictly into Triton's messages: a field they lack fails here, a value that differs fails below.
    assert json_format.ParseDict(http_config, mc.ModelConfig()) == grpc_config
    extras = {"state", "parameters"}  # HTTP metadata's own fields, which ModelMetadataResponse has no room for
    oip_meta = {key: value for key, value in http_meta.items() if key not in extras}
    assert json_format.ParseDict(oip_meta, pb.ModelMetadataResponse()) == grpc_meta
    assert grpc_meta.platform == grpc_config.platform == PLATFORM_OF[model]
    assert grpc_config.dynamic_batching.priority_levels == 2  # the default lanes: high, normal


def test_the_timeout_parameter_has_one_rule_on_both_ports(slow_server):
    fraction = httpx.post(slow_server.url + "/v2/models/slow/infer", json=infer_body(1.0, timeout=1500.5))
    assert fraction.status_code == 422 and "parameters.timeout" in fraction.json()["error"]  # OIP: a message

    def grpc_infer(timeout: float) -> pb.ModelInferResponse:
        request = pb.ModelInferRequest(model_name="slow")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(np.array([[1.0]], dtype=np.float32).tobytes())
        request.parameters["timeout"].double_param = timeout
        with grpc.insecure_channel(slow_server.grpc_url) as channel:
            return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)

    with pytest.raises(grpc.RpcError) as refused:
        grpc_infer(1500.5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parameters.timeout" in refused.value.details()
    assert grpc_infer(10_000_000.0).model_name == "slow"  # a whole double (10 s) is the int it names, as over HTTP
    whole = httpx.post(slow_server.url + "/v2/models/slow/infer", json=infer_body(1.0, timeout=10_000_000.0))
    assert whole.status_code == 200
