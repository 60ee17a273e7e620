"""The default server with the built-in digits model, driven over HTTP as a user would."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

from servewell.examples.digits import DIGITS_PREPROCESS, load_split, render_digit
from servewell.imaging import transform_image

EXAMPLES = Path(__file__).parents[2] / "src" / "servewell" / "examples" / "images"


def png_bytes(x8x8: np.ndarray, size: int = 64) -> bytes:
    buf = io.BytesIO()
    render_digit(x8x8, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def test_split():
    _, x_test, _, y_test = load_split()
    return x_test, y_test


async def _predict_all(url: str, images: list[bytes], concurrency: int = 16) -> list[dict]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(blob: bytes) -> dict:
            async with gate:
                r = await client.post("/predict", json={"image_base64": base64.b64encode(blob).decode()})
                assert r.status_code == 200, r.text
                return r.json()

        return await asyncio.gather(*(one(b) for b in images))


def test_accuracy_through_predict(digits_server, test_split):
    x_test, y_test = test_split
    answers = asyncio.run(_predict_all(digits_server.url, [png_bytes(x) for x in x_test]))
    predicted = np.array([int(a["result"]["label"]) for a in answers])
    accuracy = float((predicted == y_test).mean())
    assert accuracy >= 0.95, accuracy
    assert all(a["request_id"] for a in answers)


def test_accuracy_through_oip_infer_with_tensors(digits_server, test_split):
    x_test, y_test = test_split
    # A client that preprocesses itself sends FP32 tensors, 32 rows per request.
    tensors = np.stack([transform_image(render_digit(x), DIGITS_PREPROCESS) for x in x_test]).astype(np.float32)
    predicted = []
    with httpx.Client(base_url=digits_server.url, timeout=60) as client:
        for start in range(0, len(tensors), 32):
            chunk = tensors[start : start + 32]
            r = client.post("/v2/models/digits/infer", json={
                "id": f"chunk-{start}",
                "inputs": [{"name": "input", "shape": list(chunk.shape), "datatype": "FP32",
                            "data": chunk.ravel().tolist()}],
            })
            assert r.status_code == 200, r.text
            doc = r.json()
            assert doc["id"] == f"chunk-{start}" and doc["model_name"] == "digits"
            out = doc["outputs"][0]
            assert out["name"] == "logits" and out["shape"] == [len(chunk), 10]
            predicted.extend(np.array(out["data"]).reshape(len(chunk), 10).argmax(1))
    accuracy = float((np.array(predicted) == y_test).mean())
    assert accuracy >= 0.95, accuracy


def test_accuracy_through_oip_infer_with_encoded_images(digits_server, test_split):
    x_test, y_test = test_split
    x_test, y_test = x_test[:64], y_test[:64]
    blobs = [base64.b64encode(png_bytes(x)).decode() for x in x_test]
    r = httpx.post(digits_server.url + "/v2/models/digits/infer", json={
        "inputs": [{"name": "input", "shape": [len(blobs)], "datatype": "BYTES", "data": blobs}],
    }, timeout=60)
    assert r.status_code == 200, r.text
    logits = np.array(r.json()["outputs"][0]["data"]).reshape(len(blobs), 10)
    assert float((logits.argmax(1) == y_test).mean()) >= 0.95


def test_shipped_example_images_are_classified_by_their_label(digits_server):
    files = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".png", ".jpg"))
    assert files, "example images must ship with the package"
    for path in files:
        r = httpx.post(digits_server.url + "/predict",
                       json={"image_base64": base64.b64encode(path.read_bytes()).decode()}, timeout=30)
        assert r.status_code == 200, r.text
        label = path.name.split("-")[1]
        assert r.json()["result"]["label"] == label, (path.name, r.json())


def test_tritonclient_round_trip(digits_server, test_split):
    x_test, y_test = test_split
    client = triton.InferenceServerClient(digits_server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits")
    meta = client.get_model_metadata("digits")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["outputs"][0]["name"] == "logits"
    assert client.get_model_config("digits")["max_batch_size"] >= 1
    assert {m["name"] for m in client.get_model_repository_index()} == {"digits"}

    batch = np.stack([transform_image(render_digit(x), DIGITS_PREPROCESS) for x in x_test[:16]]).astype(np.float32)
    tensor = triton.InferInput("input", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)  # binary tensor extension, the client's default
    result = client.infer("digits", [tensor], outputs=[triton.InferRequestedOutput("logits")])
    logits = result.as_numpy("logits")
    assert logits.shape == (16, 10) and logits.dtype == np.float32
    assert (logits.argmax(1) == y_test[:16]).mean() >= 0.9

    # Encoded images as a BYTES tensor, all outputs binary (no outputs named).
    images = np.array([png_bytes(x) for x in x_test[:8]], dtype=np.object_)
    tensor = triton.InferInput("input", [8], "BYTES")
    tensor.set_data_from_numpy(images)
    logits = client.infer("digits", [tensor]).as_numpy("logits")
    assert (logits.argmax(1) == y_test[:8]).mean() >= 0.85

    with pytest.raises(triton.InferenceServerException) as info:
        client.infer("nope", [tensor])
    assert info.value.status() == "404"


def test_headers_request_id_process_time_and_docs(digits_server):
    image = (EXAMPLES / sorted(p.name for p in EXAMPLES.iterdir())[0]).read_bytes()
    r = httpx.post(digits_server.url + "/predict", json={"image_base64": base64.b64encode(image).decode()},
                   headers={"X-Request-ID": "client-chosen-42"})
    assert r.headers["x-request-id"] == "client-chosen-42" == r.json()["request_id"]
    assert float(r.headers["x-process-time"]) > 0
    assert "compute;dur=" in r.headers["server-timing"]
    generated = httpx.get(digits_server.url + "/v2/health/live")
    assert len(generated.headers["x-request-id"]) >= 16 and "x-process-time" in generated.headers
    assert httpx.get(digits_server.url + "/docs").status_code == 200
    paths = httpx.get(digits_server.url + "/openapi.json").json()["paths"]
    assert "/predict" in paths and "/v2/models/{name}/infer" in paths


def test_healthz_and_server_metadata(digits_server):
    doc = httpx.get(digits_server.url + "/healthz").json()
    assert doc["status"] == "ok" and doc["models"]["digits"]["state"] == "ready"
    assert doc["models"]["digits"]["rss_bytes"] > 10_000_000
    assert doc["models"]["digits"]["instances"][0]["alive"] is True
    assert httpx.get(digits_server.url + "/v2").json()["name"] == "servewell"


def test_urgent_request_is_served(digits_server):
    image = (EXAMPLES / sorted(p.name for p in EXAMPLES.iterdir())[0]).read_bytes()
    r = httpx.post(digits_server.url + "/predict",
                   json={"image_base64": base64.b64encode(image).decode(), "urgency": "high"},
                   headers={"X-Urgency": "high"})
    assert r.status_code == 200


FAST_PATH = "servewell_http_fast_path_requests"
INFER, INFER_VERSION = "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"


def _samples(url: str, family_name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == family_name:
            for sample in family.samples:
                if sample.name.endswith(("_total", "_count")):
                    found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _grown(before: dict, after: dict) -> dict:
    return {key: value - before.get(key, 0) for key, value in after.items() if value != before.get(key, 0)}


def test_inference_requests_take_the_fast_path_and_everything_else_goes_through_fastapi(digits_server):
    url = digits_server.url
    image = base64.b64encode(sorted(p for p in EXAMPLES.iterdir() if p.suffix == ".png")[0].read_bytes()).decode()
    tensor = {"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}]}
    version = httpx.get(url + "/v2/models/digits").json()["versions"][0]
    fast_before = _samples(url, FAST_PATH)
    timed_before = _samples(url, "servewell_request_duration_seconds")

    answers = [httpx.post(url + "/predict", json={"image_base64": image}),
               httpx.post(url + "/v2/models/digits/infer", json=tensor),
               httpx.post(url + f"/v2/models/digits/versions/{version}/infer", json=tensor)]
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert all(r.headers["x-request-id"] and "compute;dur=" in r.headers["server-timing"] for r in answers)
    # A refusal on the fast path: OIP's error shape, the code in X-Error-Code, the request id.
    missing = httpx.post(url + "/v2/models/nope/infer", json=tensor, headers={"X-Request-ID": "fast-404"})
    assert missing.status_code == 404 and missing.headers["x-error-code"] == "not_found"
    assert missing.json() == {"error": missing.json()["error"], "code": "not_found", "request_id": "fast-404"}
    # Left to FastAPI, which answers them as it always did.
    wrong_method = httpx.get(url + "/v2/models/digits/infer")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert httpx.head(url + "/v2/models/digits/infer").status_code == 405
    slash = httpx.post(url + "/v2/models/digits/infer/", json=tensor)
    assert slash.status_code == 307 and slash.headers["location"].endswith("/v2/models/digits/infer")
    assert httpx.get(url + "/v2/models/digits").status_code == 200

    # Exactly the POSTs to the three inference templates were dispatched without FastAPI's routing.
    assert _grown(fast_before, _samples(url, FAST_PATH)) == {
        (("route", "/predict"),): 1, (("route", INFER),): 2, (("route", INFER_VERSION),): 1}
    # ... and the request metrics still name them by their route template.
    timed = _grown(timed_before, _samples(url, "servewell_request_duration_seconds"))
    assert timed[(("model", "digits"), ("route", INFER_VERSION), ("status_class", "2xx"))] == 1
    assert timed[(("model", "-"), ("route", INFER), ("status_class", "4xx"))] == 2  # the 404 and the GET's 405


def test_openapi_documents_the_inference_operations_with_their_request_bodies(digits_server):
    paths = httpx.get(digits_server.url + "/openapi.json").json()["paths"]
    for path, media in (("/predict", {"application/json"}),
                        (INFER, {"application/json", "application/octet-stream"}),
                        (INFER_VERSION, {"application/json", "application/octet-stream"})):
        operation = paths[path]["post"]
        assert operation["requestBody"]["required"] is True and set(operation["requestBody"]["content"]) == media
        assert {"200", "400", "404", "413", "415", "422", "503"} <= set(operation["responses"]), path
        names = {(p["in"], p["name"]) for p in operation["parameters"]}
        assert {("header", "X-Urgency"), ("header", "X-Request-Timeout-Ms")} <= names, path
    predict_body = paths["/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert predict_body["required"] == ["image_base64"]
    infer_body = paths[INFER_VERSION]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert infer_body["required"] == ["inputs"]
    assert {p["name"] for p in paths[INFER_VERSION]["post"]["parameters"] if p["in"] == "path"} == {"name", "version"}
