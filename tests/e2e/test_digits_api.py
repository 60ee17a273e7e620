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
