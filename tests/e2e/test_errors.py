"""Every kind of bad input gets its status, a JSON error body, and loses nothing for others."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from error_bodies import error_of
from example_images import GOOD_IMAGE

PLANTED = "PLANTED-PAYLOAD-7f3a9c"


def huge_png() -> str:
    """A 5000x4000 blank PNG: tiny on the wire, 20 megapixels once decoded."""
    buf = io.BytesIO()
    Image.new("L", (5000, 4000), 255).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


def tensor(name="input", shape=(1, 1, 8, 8), datatype="FP32", data=None):
    count = 1
    for d in shape:
        count *= d
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": data if data is not None else [0.0] * count}


JSON = {"Content-Type": "application/json"}

CASES = [
    # (id, method, path, kwargs, status, code)
    ("malformed-json-predict", "POST", "/predict", {"content": b'{"image_base64": ', "headers": JSON}, 400, "bad_request"),
    ("malformed-json-infer", "POST", "/v2/models/digits/infer", {"content": b"{oops", "headers": JSON}, 400, "bad_request"),
    ("bad-base64", "POST", "/predict", {"json": {"image_base64": "%%%not-base64" + PLANTED}}, 400, "bad_request"),
    ("undecodable-image", "POST", "/predict",
     {"json": {"image_base64": base64.b64encode(PLANTED.encode() * 10).decode()}}, 400, "bad_request"),
    ("unknown-model-predict", "POST", "/predict", {"json": {"image_base64": GOOD_IMAGE, "model": "nope"}}, 404, "not_found"),
    ("unknown-model-metadata", "GET", "/v2/models/nope", {}, 404, "not_found"),
    ("unknown-version", "GET", "/v2/models/digits/versions/9", {}, 404, "not_found"),
    ("unknown-version-infer", "POST", "/v2/models/digits/versions/9/infer", {"json": {"inputs": [tensor()]}}, 404, "not_found"),
    ("unknown-route", "GET", "/nothing-here", {}, 404, "not_found"),
    ("body-too-large", "POST", "/predict", {"json": {"image_base64": "A" * 1_200_000}}, 413, "payload_too_large"),
    ("image-too-many-pixels", "POST", "/predict", {"json": {"image_base64": huge_png()}}, 413, "payload_too_large"),
    ("wrong-content-type", "POST", "/predict",
     {"content": b"image_base64=" + PLANTED.encode(), "headers": {"Content-Type": "text/plain"}}, 415, "unsupported_media_type"),
    ("wrong-content-type-infer", "POST", "/v2/models/digits/infer",
     {"content": b"x", "headers": {"Content-Type": "multipart/form-data"}}, 415, "unsupported_media_type"),
    ("missing-field", "POST", "/predict", {"json": {"image": GOOD_IMAGE}}, 422, "invalid_input"),
    ("bad-urgency", "POST", "/predict", {"json": {"image_base64": GOOD_IMAGE, "urgency": "asap"}}, 422, "invalid_input"),
    ("wrong-tensor-name", "POST", "/v2/models/digits/infer", {"json": {"inputs": [tensor(name="pixels")]}}, 422, "invalid_input"),
    ("wrong-tensor-shape", "POST", "/v2/models/digits/infer", {"json": {"inputs": [tensor(shape=(1, 8, 8))]}}, 422, "invalid_input"),
    ("wrong-tensor-dtype", "POST", "/v2/models/digits/infer",
     {"json": {"inputs": [tensor(datatype="INT32", data=[0] * 64)]}}, 422, "invalid_input"),
    ("data-does-not-fill-shape", "POST", "/v2/models/digits/infer",
     {"json": {"inputs": [tensor(data=[1.0, 2.0])]}}, 422, "invalid_input"),
    ("batch-too-large", "POST", "/v2/models/digits/infer", {"json": {"inputs": [tensor(shape=(65, 1, 8, 8))]}}, 422, "invalid_input"),
    ("unknown-output", "POST", "/v2/models/digits/infer",
     {"json": {"inputs": [tensor()], "outputs": [{"name": "probs"}]}}, 422, "invalid_input"),
    ("bad-timeout-header", "POST", "/predict",
     {"json": {"image_base64": GOOD_IMAGE}, "headers": {"X-Request-Timeout-Ms": "soon"}}, 422, "invalid_input"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_json_error_and_the_server_keeps_serving(digits_server, case):
    _, method, path, kwargs, status, code = case
    with httpx.Client(base_url=digits_server.url, timeout=30) as client:
        r = client.request(method, path, **kwargs)
        assert r.status_code == status, r.text
        error = error_of(r)
        assert error["code"] == code
        assert error["message"] and error["request_id"] == r.headers["x-request-id"]
        good = client.post("/predict", json={"image_base64": GOOD_IMAGE})
        assert good.status_code == 200 and good.json()["result"]["label"].isdigit()


def test_request_bodies_never_reach_the_log(digits_server):
    with httpx.Client(base_url=digits_server.url, timeout=30) as client:
        client.post("/predict", json={"image_base64": "%%" + PLANTED})
        client.post("/predict", content=PLANTED.encode(), headers={"Content-Type": "text/plain"})
        planted_image = base64.b64encode(PLANTED.encode()).decode()
        client.post("/v2/models/digits/infer", json={"inputs": [tensor(shape=(1,), datatype="BYTES", data=[planted_image])]})
        client.post("/v2/models/digits/infer", json={"inputs": [tensor(data=[1.5] * 63 + [PLANTED])]})
    log = digits_server.log()
    assert "request failed" in log  # errors are logged...
    assert PLANTED not in log  # ...but never the payload
    assert GOOD_IMAGE[:40] not in log
