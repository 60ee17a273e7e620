"""A hostile client against the running server (issue 11): malformed OIP requests, unbounded echoes,
label flooding, disconnects, overload floods, odd images. Each attack gets a 4xx JSON answer (or a
bounded effect) and the server keeps serving everyone else."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import re
import secrets
import socket
import time

import httpx
import numpy as np
import orjson
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from error_bodies import error_code, error_of
from example_images import GOOD_IMAGE
from model_dirs import slow_model

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def tensor_server(tmp_path_factory, start_module_server):
    """A server with an echo model (y = x) and a slow one with a queue of 2."""
    root = tmp_path_factory.mktemp("hostile-repo")
    slow_model(root, "echo", 0, max_batch_size=4)
    slow_model(root, "tiny_queue", 150, max_batch_size=1, batching={"max_queue_size": 2})
    srv = start_module_server(["--model-repository", str(root)])
    srv.wait_ready()
    return srv


def eventually(check, timeout_s: float = 10.0):
    """Poll `check` until it returns a true value (returned) or `timeout_s` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, "condition not met in time"
            return value
        time.sleep(0.05)


def samples(url: str, family: str) -> dict[tuple, float]:
    """Samples of one metric family: {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name == family:
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def request_counts(url: str, route: str) -> dict[str, float]:
    """servewell_request_duration_seconds_count by status class, for one route."""
    counts: dict[str, float] = {}
    for (name, labels), value in samples(url, "servewell_request_duration_seconds").items():
        labels = dict(labels)
        if name.endswith("_count") and labels["route"] == route:
            counts[labels["status_class"]] = counts.get(labels["status_class"], 0) + value
    return counts


def assert_client_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500 and (status is None or r.status_code == status), r.text[:500]
    error = error_of(r)
    assert error["code"] and error["request_id"] == r.headers["x-request-id"]
    assert len(r.content) < 2048
    return error


def deep(depth: int, leaf: bytes) -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def oip(tensor: bytes) -> bytes:
    return b'{"inputs": [' + tensor + b"]}"


MALFORMED_OIP = [
    ("datatype-object", oip(b'{"name": "x", "shape": [1, 1], "datatype": {"a": 1}, "data": [1]}')),
    ("datatype-list", oip(b'{"name": "x", "shape": [1, 1], "datatype": ["FP32"], "data": [1]}')),
    (
        "shape-product-overflow",
        oip(b'{"name": "x", "shape": [4294967296, 4294967296], "datatype": "FP32", "data": []}'),
    ),
    (
        "shape-65-dims",
        oip(b'{"name": "x", "shape": [' + b", ".join([b"1"] * 65) + b'], "datatype": "FP32", "data": [1]}'),
    ),
    (
        "outputs-parameters-list",
        b'{"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}], '
        b'"outputs": [{"name": "y", "parameters": [1]}]}',
    ),
    (
        "bytes-nested-1000-deep",
        oip(b'{"name": "x", "shape": [1], "datatype": "BYTES", "data": ' + deep(1000, b'"a"') + b"}"),
    ),
    ("null-in-fp32", oip(b'{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [null]}')),
]


@pytest.mark.parametrize("raw", [c[1] for c in MALFORMED_OIP], ids=[c[0] for c in MALFORMED_OIP])
def test_malformed_oip_requests_get_a_client_error(tensor_server, raw):
    with httpx.Client(base_url=tensor_server.url, timeout=30) as c:
        assert_client_error(c.post("/v2/models/echo/infer", content=raw, headers=JSON))
        ok = c.post(
            "/v2/models/echo/infer",
            json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [2.5]}]},
        )
        assert ok.status_code == 200 and ok.json()["outputs"][0]["data"] == [2.5]


def test_binary_shape_overflow_gets_a_client_error(tensor_server):
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [4294967296, 4294967296],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 0},
                }
            ]
        }
    )
    r = httpx.post(
        tensor_server.url + "/v2/models/echo/infer",
        content=header,
        headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))},
    )
    assert_client_error(r, 422)


@pytest.mark.parametrize(
    "value", ["１２".encode(), b"9" * 5000, b"-3", b"0x10"], ids=["non-ascii", "5000-digits", "negative", "hex"]
)
def test_bad_inference_header_content_length_gets_400(tensor_server, value):
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]})
    r = httpx.post(
        tensor_server.url + "/v2/models/echo/infer",
        content=header,
        headers=[(b"Content-Type", b"application/octet-stream"), (b"Inference-Header-Content-Length", value)],
    )
    assert_client_error(r, 400)


def test_non_finite_outputs_are_null_in_json_and_exact_in_binary(tensor_server):
    values = np.array([[np.nan], [np.inf], [-np.inf], [1.5]], dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [4, 1], "datatype": "FP32", "parameters": {"binary_data_size": values.nbytes}}
            ]
        }
    )
    url = tensor_server.url + "/v2/models/echo/infer"
    binary = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    r = httpx.post(url, content=header + values.tobytes(), headers=binary)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [None, None, None, 1.5]
    header = orjson.dumps({**orjson.loads(header), "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
    binary["Inference-Header-Content-Length"] = str(len(header))
    r = httpx.post(url, content=header + values.tobytes(), headers=binary)
    length = int(r.headers["inference-header-content-length"])
    got = np.frombuffer(r.content[length:], dtype="<f4")
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.5


def log_since(server, offset: int) -> str:
    return server.log()[offset:]


def test_echoed_client_strings_are_bounded_in_bodies_and_logs(tensor_server):
    planted = "Z" * 4000
    offset = len(tensor_server.log())
    with httpx.Client(base_url=tensor_server.url, timeout=30) as c:
        r = c.post(
            "/v2/models/echo/infer",
            json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]},
            headers={"X-Request-Timeout-Ms": planted},
        )
        assert_client_error(r, 422)
        assert_client_error(c.post(f"/v2/models/{planted}/infer", json={"inputs": []}), 404)
        assert_client_error(c.get(f"/v2/models/{planted}/config"), 404)
        tensor = {"name": planted, "shape": [1, 1], "datatype": planted, "data": [1]}
        assert_client_error(c.post("/v2/models/echo/infer", json={"inputs": [tensor]}), 422)
        tensor["datatype"] = "FP32"
        assert_client_error(c.post("/v2/models/echo/infer", json={"inputs": [tensor]}), 422)
        assert_client_error(
            c.post("/v2/models/echo/infer", json={"inputs": [{**tensor, "name": "x"}], "outputs": [{"name": planted}]}),
            422,
        )
        assert_client_error(c.post("/predict", json={"image_base64": "AAAA", planted: 1}), 422)
        assert_client_error(c.post("/predict", content=b"x", headers={"Content-Type": planted}), 415)
    lines = eventually(lambda: log_since(tensor_server, offset).splitlines())
    assert lines and max(len(line) for line in lines) < 2000
    assert "Z" * 100 not in log_since(tensor_server, offset)


def test_random_model_names_never_grow_the_metrics(tensor_server):
    url = tensor_server.url
    tensor = {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}

    async def flood(names):
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=16)) as c:
            sem = asyncio.Semaphore(16)

            async def one(i, name):
                async with sem:
                    kind = i % 5
                    if kind == 0:
                        return await c.post(f"/v2/models/{name}/infer", json={"inputs": [tensor]})
                    if kind == 1:
                        return await c.get(f"/v2/models/{name}")
                    if kind == 2:
                        return await c.get(f"/v2/models/{name}/ready")
                    if kind == 3:
                        return await c.get(f"/v2/models/{name}/versions/{name}/config")
                    return await c.post("/predict", json={"image_base64": GOOD_IMAGE, "model": name})

            return await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))

    asyncio.run(flood([f"warm{i}" for i in range(10)]))  # every route's series exists before the baseline
    before = httpx.get(url + "/metrics").text
    names = [secrets.token_hex(12) for _ in range(2000)]
    answers = asyncio.run(flood(names))
    assert {r.status_code for r in answers} == {404}
    after = httpx.get(url + "/metrics").text
    assert not any(name in after for name in names)
    # The same series with larger counts: the size may only grow by the digits of the counts.
    assert len(after) - len(before) < 2000, (len(before), len(after))


def raw_request(port: int, head: str, body: bytes, close_after_s: float = 0.2) -> None:
    """Send a request head and part of its body on a raw socket, then drop the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head.encode() + body)
        time.sleep(close_after_s)


@pytest.mark.parametrize("route,path", [("/predict", "/predict"), ("/v2/models/{name}/infer", "/v2/models/echo/infer")])
def test_a_client_that_drops_mid_upload_is_cancelled_not_a_server_error(tensor_server, route, path):
    """The body never arrives: the app is never started for it (api/http_limits.py reads a body of
    known size before the app runs), so nothing is counted or logged as a failure; the model is
    none the worse, as a complete request after it shows."""
    url = tensor_server.url
    before = request_counts(url, route)
    offset = len(tensor_server.log())
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    raw_request(tensor_server.port, head, b'{"inputs": [' + b" " * 5000)
    complete = httpx.post(url + "/v2/models/echo/infer", json={"inputs": [
        {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]})
    assert complete.status_code == 200  # proves the counts below were read after the server moved on
    after = request_counts(url, route)
    assert after.get("5xx", 0) == before.get("5xx", 0) and after.get("4xx", 0) == before.get("4xx", 0), after
    log = log_since(tensor_server, offset)
    assert "Traceback" not in log and '"level":"error"' not in log and '"level":"warning"' not in log


def test_overload_refusals_are_logged_once_per_model_code_and_second(tensor_server):
    url = tensor_server.url
    offset = len(tensor_server.log())
    tensor = {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(
                *(c.post("/v2/models/tiny_queue/infer", json={"inputs": [tensor]}) for _ in range(48))
            )

    answers = asyncio.run(burst())
    refused = sum(1 for r in answers if r.status_code == 503)
    assert refused >= 20

    def digest_lines():
        lines = [orjson.loads(line) for line in log_since(tensor_server, offset).splitlines() if line.startswith("{")]
        mine = [e for e in lines if e.get("code") == "overloaded"]
        return mine if sum(e.get("count", 1) for e in mine) >= refused else None

    lines = eventually(digest_lines, timeout_s=5)
    assert sum(e["count"] for e in lines) == refused  # the log still accounts for every refusal...
    assert len(lines) <= 4  # ...in a line per second, not one per request
    assert all(e["model"] == "tiny_queue" and e["level"] == "warning" for e in lines)


def test_405_carries_allow(tensor_server):
    r = httpx.get(tensor_server.url + "/predict")
    assert_client_error(r, 405)
    assert r.headers["allow"] == "POST"
    r = httpx.delete(tensor_server.url + "/v2/models/echo")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_loading_a_model_with_a_300_character_name_is_404_not_500(tensor_server):
    r = httpx.post(tensor_server.url + "/v2/repository/models/" + "m" * 300 + "/load")
    assert_client_error(r, 404)


def test_a_second_concurrent_profile_is_409(tensor_server):
    async def main():
        async with httpx.AsyncClient(base_url=tensor_server.url, timeout=60) as c:
            first = asyncio.create_task(c.post("/admin/models/echo/profile", params={"seconds": 3}))
            seconds = []
            for _ in range(40):
                await asyncio.sleep(0.1)
                r = await c.post("/admin/models/echo/profile", params={"seconds": 1})
                seconds.append(r)
                if r.status_code == 409:
                    break
            return await first, seconds

    first, seconds = asyncio.run(main())
    assert first.status_code == 200
    assert seconds[-1].status_code == 409 and error_code(seconds[-1]) == "conflict"
    assert all(r.status_code in (200, 409) for r in seconds)


def png(width: int, height: int, mode: str = "L", value: int = 255) -> str:
    buf = io.BytesIO()
    Image.new(mode, (width, height), value).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("size", [(1, 13000), (13000, 1), (1, 12000)], ids=["1x13000", "13000x1", "1x12000"])
def test_long_thin_images_below_the_pixel_limit_are_classified(digits_server, size):
    r = httpx.post(digits_server.url + "/predict", json={"image_base64": png(*size)}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["label"].isdigit()


def test_an_image_side_above_the_limit_is_refused_from_its_header(digits_server):
    r = httpx.post(digits_server.url + "/predict", json={"image_base64": png(1, 40000)}, timeout=30)
    error = assert_client_error(r, 413)
    assert "side" in error["message"]


ECHO_TENSOR = b'{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}'


def test_an_input_given_twice_is_refused_naming_it(tensor_server):
    url = tensor_server.url + "/v2/models/echo/infer"
    twice = assert_client_error(httpx.post(url, content=b'{"inputs": [' + ECHO_TENSOR + b", " + ECHO_TENSOR + b"]}"))
    assert "'x' is given more than once" in twice["message"]


def test_a_priority_past_the_models_lanes_is_refused_naming_the_range(tensor_server):
    url = tensor_server.url + "/v2/models/echo/infer"
    for priority in (3, 99, 2**40):
        body = b'{"inputs": [' + ECHO_TENSOR + b'], "parameters": {"priority": %d}}' % priority
        refused = assert_client_error(httpx.post(url, content=body), 422)
        assert "0..2" in refused["message"]
    body = b'{"inputs": [' + ECHO_TENSOR + b'], "parameters": {"priority": 2}}'
    assert httpx.post(url, content=body).status_code == 200


def test_a_gzip_body_followed_by_junk_or_cut_short_is_400(tensor_server):
    url = tensor_server.url + "/v2/models/echo/infer"
    packed = gzip.compress(b'{"inputs": [' + ECHO_TENSOR + b"]}")
    headers = {"Content-Encoding": "gzip"}
    assert httpx.post(url, content=packed, headers=headers).status_code == 200
    junk = assert_client_error(httpx.post(url, content=packed + b"junk", headers=headers), 400)
    assert "after the end" in junk["message"]
    assert_client_error(httpx.post(url, content=packed[:-4], headers=headers), 400)


def test_head_is_answered_like_get_without_a_body(tensor_server):
    for path in ("/healthz", "/v2/models/echo", "/metrics"):
        get, head = httpx.get(tensor_server.url + path), httpx.head(tensor_server.url + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
    assert httpx.head(tensor_server.url + "/predict").status_code == 405  # POST only: still 405


def test_docs_load_nothing_from_another_origin(tensor_server):
    page = httpx.get(tensor_server.url + "/docs")
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    assert "http" not in page.text.replace("http-equiv", "")  # every asset is a same-origin path
    assets = re.findall(r'(?:src|href)="(/console/assets/docs/[^"]+)"', page.text)
    assert len(assets) == 3
    for asset in assets:
        assert httpx.get(tensor_server.url + asset).status_code == 200
    assert httpx.get(tensor_server.url + "/redoc").status_code == 404  # ReDoc came from a CDN too
