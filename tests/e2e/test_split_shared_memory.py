"""Request and result tensors through shared memory between the ingress processes and the engine
(`--shared-tensor-min-bytes 0`: every tensor goes that way) give every client exactly the answer
the inline path gives, under concurrency (a block is never reused while another request's arrays
lie over it), over JSON, binary HTTP and gRPC; an ingress killed with its blocks in use leaves no
segment behind."""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from servers import ServerFactory, ServerProcess
from waiting import eventually

ROWS = np.random.default_rng(7).random((48, 1, 1, 8, 8), dtype=np.float32)


def _children(pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"engine": [], "ingress": []}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as file:
            for child in (int(p) for p in file.read().split()):
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    argv = cmd.read()
                if b"servewell.engine_main" in argv or argv.startswith(b"servewell engine\0"):
                    out["engine"].append(child)
                elif b"servewell.ingress_main" in argv or argv.startswith(b"servewell ingress "):
                    out["ingress"].append(child)
    return out


def _tensor_segments(pid: int) -> list[str]:
    """The shared-tensor segments of process `pid` (named `servewell-<pid>-<serial>-t<n>`)."""
    return [name for name in os.listdir("/dev/shm") if re.fullmatch(rf"servewell-{pid}-\d+-t\d+", name)]


def _json(server: ServerProcess, row: np.ndarray) -> list[float]:
    body = {"inputs": [{"name": "input", "shape": list(row.shape), "datatype": "FP32",
                        "data": row.reshape(-1).tolist()}]}
    with httpx.Client(base_url=server.url, timeout=20) as client:  # a fresh connection: either ingress
        answer = client.post("/v2/models/digits/infer", json=body)
    assert answer.status_code == 200, answer.text
    data: list[float] = answer.json()["outputs"][0]["data"]
    return data


def _binary(server: ServerProcess, row: np.ndarray) -> np.ndarray:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        tensor = triton.InferInput("input", list(row.shape), "FP32")
        tensor.set_data_from_numpy(row, binary_data=True)
        result = client.infer("digits", [tensor], outputs=[triton.InferRequestedOutput("logits", binary_data=True)])
        out: np.ndarray = result.as_numpy("logits")
        return out
    finally:
        client.close()


def _grpc(server: ServerProcess, row: np.ndarray) -> np.ndarray:
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=list(row.shape))
    request.raw_input_contents.append(row.tobytes())
    with grpc.insecure_channel(server.grpc_url, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=20)
    return np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)


@pytest.fixture(scope="module")
def servers(servewell_cache: Path, start_module_server: ServerFactory) -> tuple[ServerProcess, ServerProcess]:
    base = ["--cache-dir", str(servewell_cache), "--ingress-processes", "2"]
    shared = start_module_server([*base, "--shared-tensor-min-bytes", "0"])
    inline = start_module_server([*base, "--shared-tensor-limit-bytes", "0"])
    shared.wait_ready()
    inline.wait_ready()
    return shared, inline


def test_every_protocol_answers_through_shared_memory_exactly_as_inline(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    shared, inline = servers
    for row in ROWS[:4]:
        expected = np.array(_json(inline, row), dtype=np.float32)
        assert np.array_equal(np.array(_json(shared, row), dtype=np.float32), expected)
        assert np.array_equal(_binary(shared, row).reshape(-1), expected)
        assert np.array_equal(_grpc(shared, row), expected)
    # The shared path was taken: both ingress processes and the engine (outputs) hold segments;
    # the inline server's processes hold none.
    roles = _children(shared.proc.pid)
    assert all(_tensor_segments(pid) for pid in roles["engine"] + roles["ingress"]), roles
    other = _children(inline.proc.pid)
    assert not any(_tensor_segments(pid) for pid in other["engine"] + other["ingress"]), other


def test_concurrent_requests_each_get_their_own_rows_back(servers: tuple[ServerProcess, ServerProcess]) -> None:
    shared, inline = servers
    expected = [np.array(_json(inline, row), dtype=np.float32) for row in ROWS]
    with ThreadPoolExecutor(16) as pool:
        for _ in range(3):
            answers = list(pool.map(lambda row: np.array(_json(shared, row), dtype=np.float32), ROWS))
            for got, want in zip(answers, expected, strict=True):
                assert np.array_equal(got, want)


def test_an_ingress_killed_with_blocks_leaves_no_segment_and_serving_goes_on(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    shared, _ = servers
    supervisor = shared.proc.pid
    before = _children(supervisor)
    for row in ROWS[:8]:
        _json(shared, row)
    victim = next(pid for pid in before["ingress"] if _tensor_segments(pid))
    os.kill(victim, signal.SIGKILL)
    eventually(lambda: not _tensor_segments(victim) or None, 30, "the killed ingress's segments were not removed")

    def replaced() -> list[int] | None:
        pids = _children(supervisor)["ingress"]
        return pids if len(pids) == 2 and victim not in pids else None

    eventually(replaced, 30, "the killed ingress process was not replaced")
    assert all(len(_json(shared, row)) == 10 for row in ROWS[:8])


def test_a_large_body_arriving_in_pieces_large_and_tiny_is_read_whole_and_in_order(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    import socket
    import time

    shared, inline = servers
    row = ROWS[5]
    expected = _json(inline, row)
    doc = {"inputs": [{"name": "input", "shape": list(row.shape), "datatype": "FP32",
                       "data": row.reshape(-1).tolist()}]}
    # 300 kB, the document between runs of whitespace (JSON allows it): a piece lost or out of
    # order fails the parse or changes the answer.
    body = b" " * 150_000 + json.dumps(doc).encode() + b"\n" * 150_000
    host, port = shared.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(f"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        start, sizes = 0, [100, 16_384, 7, 16_384, 16_384, 3_000]  # tiny pieces gathered, large ones kept
        while start < len(body):
            piece = sizes[start % len(sizes)]
            sock.sendall(body[start:start + piece])
            start += piece
            time.sleep(0.002)  # separate reads on the server's side
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(payload)["outputs"][0]["data"] == expected
