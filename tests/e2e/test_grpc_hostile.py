"""Hostile gRPC clients (issue 19: idle connections, slowloris, protocol correctness; issue 18:
GOAWAY at shutdown), each sent for real in a small bounded form against a server with small limits."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from model_dirs import slow_model
from waiting import eventually

KEY = "hostile-key-one-0123456789"
SLOW_KEY = "hostile-key-two-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
CAP = 6  # per process serving gRPC: each ingress process has its own cap and call slots
SLOTS = 4
INGRESS = 2
RECEIVE_S = 2.0
INFER = "/inference.GRPCInferenceService/ModelInfer"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("grpc-hostile")
    slow_model(root, "slow", 400, max_batch_size=1)
    started = start_module_server(
        ["--model-repository", str(root), "--grpc-max-connections", str(CAP), "--grpc-max-concurrent-rpcs",
         str(SLOTS), "--grpc-receive-timeout-s", str(RECEIVE_S), "--grpc-handshake-timeout-s", "2",
         "--grpc-idle-timeout-s", "4", "--grpc-max-streams-per-connection", "20", "--ingress-processes",
         str(INGRESS)],
        env={"SERVEWELL_API_KEYS": f"a:{KEY},b:{SLOW_KEY} rate=0.2"},
    )
    started.wait_ready()
    return started


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (short strings only)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def open_raw(url: str) -> socket.socket:
    """A TCP connection to the gRPC port that has sent the HTTP/2 preface and an empty SETTINGS."""
    host, port = url.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(PREFACE + frame(4, 0, 0))
    if frames_until(sock, 4, 2.0):  # the server's SETTINGS, acknowledged as a real client does
        sock.sendall(frame(4, 1, 0))
    return sock


def send_incomplete_infer(sock: socket.socket, stream: int, key: str = KEY) -> None:
    """A ModelInfer call whose message declares 1,000 bytes and sends 5."""
    block = b"".join(literal(n, v) for n, v in ((":method", "POST"), (":scheme", "http"), (":path", INFER),
                                                  (":authority", "x"), ("content-type", "application/grpc"),
                                                  ("te", "trailers"), ("authorization", f"Bearer {key}")))
    sock.sendall(frame(1, 0x4, stream, block) + frame(0, 0, stream, b"\x00" + struct.pack(">I", 1000) + b"abcde"))


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (whatever it sends first is read and dropped)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def frames_until(sock: socket.socket, kind: int, within_s: float) -> bool:
    """Whether a frame of `kind` arrives on `sock` within `within_s`."""
    deadline, buffer = time.monotonic() + within_s, b""
    while time.monotonic() < deadline:
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            if buffer[3] == kind:
                return True
            buffer = buffer[9 + length:]
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return False
        if not data:
            return False
        buffer += data
    return False


def x_input(value: float = 1.0) -> list[triton.InferInput]:
    t = triton.InferInput("x", [1, 1], "FP32")
    t.set_data_from_numpy(np.array([[value]], dtype=np.float32))
    return [t]


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_connections_past_the_cap_are_closed_and_http_and_grpc_stay_served(server):
    with triton.InferenceServerClient(server.grpc_url) as legit:
        assert legit.infer("slow", x_input(), headers=AUTH).as_numpy("y") is not None  # its connection is open
        # The kernel spreads connections over the ingress processes by a hash, not evenly; whatever the
        # spread, at least (connections - INGRESS * CAP) of them are past some process's cap.
        flood = [open_raw(server.grpc_url) for _ in range(INGRESS * CAP + 6)]
        try:
            time.sleep(1.0)  # the idle timeout (4 s) is further off than this check
            refused = sum(closed_by_server(sock, 0.05) for sock in flood)
            assert refused >= 6, f"only {refused} of {len(flood)} connections past {INGRESS} caps of {CAP} were closed"
            assert httpx.get(server.url + "/v2/health/ready", timeout=5).status_code == 200
            assert legit.infer("slow", x_input(2.0), headers=AUTH).as_numpy("y") is not None
            # Idle connections (no call ever) are sent GOAWAY and closed after grpc_idle_timeout_s (4 s).
            held = [sock for sock in flood if not closed_by_server(sock, 0.01)]
            assert held and all(closed_by_server(sock, 15.0) for sock in held)
        finally:
            for sock in flood:
                sock.close()


def test_a_connection_that_never_speaks_is_closed_after_the_handshake_timeout(server):
    host, port = server.grpc_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as silent:
        assert not closed_by_server(silent, 0.5)  # it would notice a close
        assert closed_by_server(silent, 10.0)


def test_incomplete_messages_hold_no_call_slot_and_time_out(server):
    sockets = [open_raw(server.grpc_url) for _ in range(2)]
    try:
        for sock in sockets:
            for index in range(10):  # 20 incomplete calls, 5x the 4 call slots
                send_incomplete_infer(sock, 1 + 2 * index)
        time.sleep(0.5)
        with triton.InferenceServerClient(server.grpc_url) as legit:
            for value in range(3):
                assert legit.infer("slow", x_input(value), headers=AUTH).as_numpy("y") is not None

        async def headers_only() -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(server.grpc_url) as channel:
                async def never():  # headers, then no message at all
                    await asyncio.sleep(30)
                    yield b""
                call: grpc.aio.StreamUnaryCall[bytes, bytes] = channel.stream_unary(INFER)(
                    never(), metadata=tuple(AUTH.items()))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(call, RECEIVE_S + 10)
                return refused.value.code()

        started = time.monotonic()
        assert asyncio.run(headers_only()) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < RECEIVE_S + 5
    finally:
        for sock in sockets:
            sock.close()


def test_calls_over_the_slots_get_resource_exhausted_with_retry_after(server):
    async def burst() -> list[grpc.aio.AioRpcError | pb.ModelInferResponse]:
        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            infer = channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            request = pb.ModelInferRequest(model_name="slow")
            request.inputs.add(name="x", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)

            async def one() -> grpc.aio.AioRpcError | pb.ModelInferResponse:
                try:
                    return await infer(request, metadata=tuple(AUTH.items()), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return exc
            return await asyncio.gather(*(one() for _ in range(SLOTS + 4)))

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and len(results) - len(refused) >= SLOTS
    assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    trailers = dict(refused[0].trailing_metadata())
    assert trailers["servewell-error-code"] == "too_many_calls" and trailers["retry-after"] == "1"


def test_a_call_over_its_tenants_rate_carries_retry_after(server):
    # One bucket per tenant for the whole server (engine/tenants.py), whichever connection or
    # ingress process the calls come through; the same 429 code as over HTTP.
    headers = {"authorization": f"Bearer {SLOW_KEY}"}
    with triton.InferenceServerClient(server.grpc_url) as client:
        tensor = triton.InferInput("x", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
        client.infer("slow", [tensor], headers=headers)
        with pytest.raises(InferenceServerException) as limited:
            client.infer("slow", [tensor], headers=headers)
    assert "over its rate" in str(limited.value) and "RESOURCE_EXHAUSTED" in str(limited.value.status())


def test_unimplemented_calls_check_the_key_and_log_no_traceback(server):
    before = len(server.log())
    with triton.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as anonymous:
            client.get_inference_statistics("slow")
        assert code_of(anonymous.value) == "StatusCode.UNAUTHENTICATED"
        for _ in range(50):
            with pytest.raises(InferenceServerException) as unimplemented:
                client.get_inference_statistics("slow", headers=AUTH)
            assert code_of(unimplemented.value) == "StatusCode.UNIMPLEMENTED"
    with grpc.insecure_channel(server.grpc_url) as channel:
        unknown = channel.unary_unary("/no.such.Service/Nothing")
        with pytest.raises(grpc.RpcError) as refused:
            unknown(b"", metadata=tuple(AUTH.items()), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    written = server.log()[before:]
    assert "Traceback" not in written and "NotImplementedError" not in written
    assert len(written) < 5_000, f"{len(written)} bytes of log for 51 unimplemented calls"


def test_a_malformed_message_is_invalid_argument(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        infer = channel.unary_unary(INFER)  # raw bytes, no serializer
        with pytest.raises(grpc.RpcError) as malformed:
            infer(b"\x0a\xff\xff\xff\xff\x0f", metadata=tuple(AUTH.items()), timeout=10)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ModelInferRequest" in malformed.value.details()


def test_raw_and_typed_contents_together_are_refused(server):
    request = pb.ModelInferRequest(model_name="slow")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
    request.raw_input_contents.append(np.array([[2.0]], dtype=np.float32).tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        infer = channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as both:
            infer(request, metadata=tuple(AUTH.items()), timeout=10)
    assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in both.value.details() and "'x'" in both.value.details()


def test_model_ready_needs_the_key_and_names_no_other_model(server):
    with triton.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as anonymous:
            client.is_model_ready("slow")
        assert code_of(anonymous.value) == "StatusCode.UNAUTHENTICATED"
        assert client.is_model_ready("slow", headers=AUTH)
        with pytest.raises(InferenceServerException) as unknown:
            client.is_model_ready("nope", headers=AUTH)
    assert code_of(unknown.value) == "StatusCode.NOT_FOUND"
    assert "nope" in unknown.value.message() and "slow" not in unknown.value.message()


def test_shutdown_sends_goaway_when_readiness_turns_false(tmp_path, start_server):
    slow_model(tmp_path, "slow", 1500, max_batch_size=1)
    stopping = start_server(["--model-repository", str(tmp_path)], env={"SERVEWELL_SHUTDOWN_DELAY_S": "4"})
    stopping.wait_ready()
    watcher = open_raw(stopping.grpc_url)
    try:
        assert not frames_until(watcher, 7, 0.5)  # no GOAWAY while serving: it would notice one
        with triton.InferenceServerClient(stopping.grpc_url) as client:
            results: list[object] = []
            client.async_infer("slow", x_input(3.0), lambda result, error: results.append(error or result))
            time.sleep(0.3)  # the call is in flight
            stopping.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert frames_until(watcher, 7, 2.0), "no GOAWAY within 2 s of SIGTERM (the delay is 4 s)"
            assert time.monotonic() - signalled < 3.0
            eventually(lambda: bool(results), 10, lambda: "the call in flight never finished")
        assert not isinstance(results[0], Exception), results[0]
        assert httpx.get(stopping.url + "/v2/health/ready", timeout=5).status_code == 503  # HTTP still answers
    finally:
        watcher.close()


class IdleFlood:
    """Raw HTTP/2 connections that send the preface and SETTINGS and nothing more, renewed as the
    server closes them (as an attacker renews them)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sockets: list[socket.socket] = []
        self.closed_by_server = 0

    def top_up(self, count: int) -> None:
        """Forget the connections the server closed, then open new ones until `count` are held."""
        held = []
        for sock in self.sockets:
            sock.setblocking(False)
            try:
                ended = sock.recv(65536, socket.MSG_PEEK) == b""
            except BlockingIOError:
                ended = False
            except OSError:
                ended = True
            if ended:
                self.closed_by_server += 1
                sock.close()
            else:
                held.append(sock)
        self.sockets = held
        while len(self.sockets) < count:
            self.sockets.append(open_raw(self.url))

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


CAPPED = 50  # the connection cap of the `capped` server (one ingress process: one cap)


@pytest.fixture(scope="module")
def capped(tmp_path_factory, start_module_server):
    """A server whose gRPC connections time out only after minutes: only making room frees places."""
    root = tmp_path_factory.mktemp("grpc-capped")
    slow_model(root, "slow", 1, max_batch_size=1)
    started = start_module_server(["--model-repository", str(root), "--grpc-max-connections", str(CAPPED),
                                   "--grpc-idle-timeout-s", "300", "--grpc-handshake-timeout-s", "120",
                                   "--ingress-processes", "1"])
    started.wait_ready()
    return started


def new_client_answers(url: str, value: float) -> bool:
    """Whether a new tritonclient.grpc client (a connection of its own) gets an answer; False when it
    is refused for want of a place (UNAVAILABLE)."""
    try:
        with triton.InferenceServerClient(url) as legit:
            return legit.infer("slow", x_input(value)).as_numpy("y") is not None
    except InferenceServerException as exc:
        assert "UNAVAILABLE" in code_of(exc), exc
        return False


def test_idle_connections_at_the_cap_give_way_to_new_clients(capped):
    """Issue 45 H18: connections that never opened a call held every place under the cap, and a new
    tritonclient.grpc client failed at once (UNAVAILABLE "Socket closed") until the idle timeout."""
    flood = IdleFlood(capped.grpc_url)
    try:
        flood.top_up(CAPPED + 10)
        first = flood.sockets[0]
        for value in range(3):  # each a new client with its own connection, the flood renewed before it
            flood.top_up(CAPPED + 10)
            eventually(lambda value=value: new_client_answers(capped.grpc_url, value), 10.0,
                       "a new gRPC client is refused while idle connections hold the cap")
        # The places were made by closing the flood's oldest connections, not by its idle timeout (300 s).
        assert first not in flood.sockets or closed_by_server(first, 5.0)
        assert flood.closed_by_server >= 10
    finally:
        flood.close()


def test_connections_that_never_finish_their_handshake_give_way_too(capped):
    """grpc core counts a connection against the cap from accept: ones that never send the preface
    held the cap for the whole handshake timeout (here 120 s)."""
    host, port = capped.grpc_url.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(CAPPED + 10)]
    try:
        eventually(lambda: new_client_answers(capped.grpc_url, 1.0), 10.0,
                   "a new gRPC client is refused while silent connections hold the cap")
        assert closed_by_server(silent[0], 5.0)  # the oldest made room
        held = [sock for sock in silent if not closed_by_server(sock, 0.05)]
        assert len(held) >= CAPPED * 3 // 4 - 3, len(held)  # but only room: three quarters of the cap are kept
    finally:
        for sock in silent:
            sock.close()
