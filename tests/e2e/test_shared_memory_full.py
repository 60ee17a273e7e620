"""A full /dev/shm (issue 45 H14: 40 of 40 requests of a small-tensor model answered 500 "No space
left on device" on a private 64 MiB /dev/shm): small requests keep being served, a request too
large for what the server holds already is answered 503 shared_memory_full naming /dev/shm (never
a 500), and everything is served again once memory is freed.

The server runs in a mount namespace of its own with a 64 MiB tmpfs on /dev/shm (`unshare -m`, as
a container's /dev/shm), filled from here through /proc/<pid>/root. That needs root."""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc
import yaml

from error_bodies import error_of
from processes import require_program
from servers import ServerFactory, ServerProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="giving the server a private /dev/shm needs root")

MODELS = textwrap.dedent('''
    import numpy as np


    class Double:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"] * 2}


    class Total:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"].sum(axis=1, keepdims=True)}
''')
SMALL = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
#: Floats of the large request: 2.4 MB, more than a worker's batch arena holds from its start (1 MiB).
LARGE = 600_000


def python_model(root: Path, name: str, entry: str, width: int, output: int) -> None:
    directory = root / name
    directory.mkdir()
    (directory / "models.py").write_text(MODELS)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "models.py", "python": {"entry": f"models:{entry}"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [width]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [output]}], "max_batch_size": 4, "warmup": False,
    }))


@pytest.fixture()
def server(tmp_path: Path, start_server: ServerFactory) -> ServerProcess:
    require_program("unshare", "util-linux")
    root = tmp_path / "models"
    root.mkdir()
    python_model(root, "small", "Double", 4, 4)
    python_model(root, "fresh", "Double", 4, 4)  # first asked only once /dev/shm is full
    python_model(root, "total", "Total", -1, 1)
    private_shm = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    srv = start_server(["--model-repository", str(root), "--config-poll-s", "0", "--max-body-bytes", str(8 << 20)],
                       wrapper=private_shm)
    srv.wait_ready()
    return srv


def fill(directory: Path) -> Path:
    """Write a file into `directory` until the filesystem is full; the file."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as out:
        while True:
            try:
                out.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return filler


def large_request(client: httpx.Client) -> httpx.Response:
    values = np.ones((1, LARGE), np.float32)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, LARGE], "datatype": "FP32",
                                       "parameters": {"binary_data_size": values.nbytes}}]})
    return client.post("/v2/models/total/infer", content=header + values.tobytes(),
                       headers={"Content-Type": "application/octet-stream",
                                "Inference-Header-Content-Length": str(len(header))})


def test_a_full_dev_shm_fails_no_small_request_and_names_itself_to_a_large_one(server: ServerProcess) -> None:
    shm = Path(f"/proc/{server.proc.pid}/root/dev/shm")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v2/models/small/infer", json=SMALL).status_code == 200
        filler = fill(shm)
        try:
            assert os.statvfs(shm).f_bavail == 0
            # Small requests, to a model already used and to one never used before (its first batch).
            for model in ("small", "fresh"):
                for _ in range(10):
                    answer = client.post(f"/v2/models/{model}/infer", json=SMALL)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
            tensor = triton_grpc.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
            grpc_answer = triton_grpc.InferenceServerClient(server.grpc_url).infer("fresh", [tensor]).as_numpy("y")
            assert grpc_answer is not None and grpc_answer.tolist() == [[2.0, 2.0, 2.0, 2.0]]

            refused = large_request(client)
            assert refused.status_code == 503, refused.text
            error = error_of(refused)
            assert error["code"] == "shared_memory_full"
            assert "/dev/shm" in error["message"] and f"{LARGE * 4}" in error["message"], error
            assert refused.headers.get("retry-after")
        finally:
            filler.unlink()
        answer = large_request(client)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [float(LARGE)]
