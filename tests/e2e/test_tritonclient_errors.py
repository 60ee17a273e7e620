"""tritonclient's HTTP client reads every servewell error on the OIP routes: `InferenceServerException`
holds OIP's `{"error": "<message>"}` string, so printing it, `message()` and `status()` give the
server's words for each class of error (a dict there made `str(e)` raise TypeError)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from error_bodies import error_of
from model_dirs import factory_model, infer_body, slow_model

ADMIN = {"Authorization": "Bearer tc-admin"}
MAX_BODY_BYTES = 65_536

BOOM = textwrap.dedent('''
    import torch
    from torch import nn


    def refuse_thirteen(x):
        if bool((x == 13).any()):
            raise ValueError("thirteen is refused by this model")


    class Boom(nn.Linear):
        def forward(self, x):
            refuse_thirteen(x)
            return x


    def build():
        return Boom(1, 1)
''')


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tc-errors")


@pytest.fixture(scope="module")
def server(root, start_module_server):
    slow_model(root, "echo", 0, max_batch_size=4)
    slow_model(root, "gone", 0, max_batch_size=4)
    factory_model(root, "boom", BOOM, max_batch_size=4, warmup=False)
    srv = start_module_server(["--model-repository", str(root), "--admin-token", "tc-admin",
                               "--max-body-bytes", str(MAX_BODY_BYTES), "--config-poll-s", "0"])
    srv.wait_ready()
    unloaded = httpx.post(srv.url + "/v2/repository/models/gone/unload", headers=ADMIN, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    return srv


def rows(name: str, values: list[float], datatype: str = "FP32") -> triton.InferInput:
    tensor = triton.InferInput(name, [len(values), 1], datatype)
    tensor.set_data_from_numpy(np.array(values, dtype=np.float32 if datatype == "FP32" else np.int32).reshape(-1, 1))
    return tensor


def broken_dir(root: Path) -> str:
    directory = root / "broken"
    directory.mkdir(exist_ok=True)
    (directory / "model.yaml").write_text("runtime: onnx\nartifact: model.onnx\n")  # and no model.onnx
    return "broken"


# (id, call on the client, status, servewell's code (not shown by tritonclient), words of the message)
CASES: list[tuple[str, Callable[[triton.InferenceServerClient, Path], Any], int, str, str]] = [
    ("400-content-encoding", lambda c, s: c.infer("echo", [rows("x", [1.0])], headers={"Content-Encoding": "br"}),
     400, "bad_request", "Content-Encoding"),
    ("401-repository-without-token", lambda c, s: c.load_model("echo"), 401, "unauthorized", "token"),
    ("404-metadata", lambda c, s: c.get_model_metadata("nope"), 404, "not_found", "nope"),
    ("404-infer", lambda c, s: c.infer("nope", [rows("x", [1.0])]), 404, "not_found", "nope"),
    ("413-body", lambda c, s: c.infer("echo", [rows("x", [1.0] * (MAX_BODY_BYTES // 4))]), 413, "payload_too_large",
     "bytes"),
    ("415-content-type", lambda c, s: c.infer("echo", [rows("x", [1.0])], headers={"Content-Type": "text/plain"}),
     415, "unsupported_media_type", "text/plain"),
    ("422-input-name", lambda c, s: c.infer("echo", [rows("pixels", [1.0])]), 422, "invalid_input", "pixels"),
    ("422-datatype", lambda c, s: c.infer("echo", [rows("x", [1.0], "INT32")]), 422, "invalid_input", "INT32"),
    ("422-load-failed", lambda c, s: c.load_model(broken_dir(s), headers=ADMIN), 422, "load_failed", "broken"),
    ("500-model-error", lambda c, s: c.infer("boom", [rows("x", [13.0])]), 500, "model_error",
     "thirteen is refused by this model"),
    ("503-not-ready", lambda c, s: c.infer("gone", [rows("x", [1.0])]), 503, "model_not_ready", "gone"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tritonclient_prints_and_inspects_every_error(server, root, case):
    _, call, status, _code, words = case
    client = triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    with pytest.raises(InferenceServerException) as info:
        call(client, root)
    e = info.value
    text = str(e)  # raised TypeError while `error` was an object
    assert isinstance(e.message(), str) and e.status() == str(status), text
    assert text == f"[{status}] {e.message()}"
    assert words in e.message() and "'code'" not in e.message(), text  # the server's words, not a dict


def test_the_same_errors_carry_their_code_and_request_id_beside_the_message(server):
    """What tritonclient cannot show (code, request id, Retry-After) is in the body and headers."""
    r = httpx.post(server.url + "/v2/models/gone/infer", json=infer_body(1.0), headers={"X-Request-ID": "tc-503"})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert error_of(r) == {"code": "model_not_ready", "message": r.json()["error"], "request_id": "tc-503"}
    r = httpx.post(server.url + "/v2/models/boom/infer", json=infer_body(13.0))
    assert r.status_code == 500 and error_of(r)["code"] == "model_error"
    assert "thirteen is refused by this model" in r.json()["error"]
    # /predict and /admin keep the richer body.
    r = httpx.get(server.url + "/admin/models/nope/batching", headers=ADMIN)
    assert r.status_code == 404 and error_of(r)["code"] == "not_found" and isinstance(r.json()["error"], dict)
