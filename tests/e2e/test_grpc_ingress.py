"""gRPC in a split server: every ingress process listens on the gRPC port (SO_REUSEPORT) and the
engine process does not; inference and repository calls work whichever ingress a connection
reached (the calls that are not inference reach the engine as control calls over its door)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from model_dirs import onnx_mlp_model
from waiting import eventually

CHANNELS = 16  # all on one of 2 ingress processes by chance: 2 in 65,536
ADMIN = (("authorization", "Bearer s3cret"),)


@pytest.fixture(scope="module")
def split_server(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("grpc-ingress")
    onnx_mlp_model(root, "tiny_onnx")
    server = start_module_server(["--model-repository", str(root), "--admin-token", "s3cret",
                                  "--ingress-processes", "2"])
    server.wait_ready()
    return server


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def role_of(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # it has just exited
        return "gone"
    if b"servewell.engine_main" in command or command[0] == b"servewell engine":  # or its process title
        return "engine"
    return "ingress" if b"servewell.ingress_main" in command or command[0].startswith(b"servewell ingress ") \
        else "other"


def sockets_on_port(port: int, state: str) -> set[int]:
    """Inodes of the TCP sockets whose local port is `port`, in `state` (0A listen, 01 established);
    grpc binds 127.0.0.1 as a v4-mapped IPv6 socket, so both tables are read."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                inodes.add(int(fields[9]))
    return inodes


def owners(pids: list[int], inodes: set[int]) -> dict[int, int]:
    """How many of `inodes` each of `pids` holds open."""
    held = {}
    for pid in pids:
        count = 0
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # it has just exited
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                count += 1
        held[pid] = count
    return held


def infer_request(value: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny_onnx")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.full((1, 4), value, dtype=np.float32).tobytes())
    return request


def test_each_ingress_serves_grpc_and_the_engine_does_not_listen(split_server):
    pids = children(split_server.proc.pid)
    roles = {pid: role_of(pid) for pid in pids}
    ingress = sorted(pid for pid, role in roles.items() if role == "ingress")
    engine = [pid for pid, role in roles.items() if role == "engine"]
    assert len(ingress) == 2 and len(engine) == 1, roles
    listening = owners([*pids, split_server.proc.pid], sockets_on_port(split_server.grpc_port, "0A"))
    assert {pid for pid, count in listening.items() if count} == set(ingress), (listening, roles)

    # Separate connections (a local subchannel pool per channel), spread by the kernel.
    channels = [grpc.insecure_channel(split_server.grpc_url, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS)]
    try:
        stubs = [service_pb2_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
        answers = set()
        holder: dict[int, list[int]] = {pid: [] for pid in ingress}  # which ingress holds each connection
        for i, stub in enumerate(stubs):
            before = owners(ingress, sockets_on_port(split_server.grpc_port, "01"))
            response = stub.ModelInfer(infer_request(float(i)), timeout=30)
            after = owners(ingress, sockets_on_port(split_server.grpc_port, "01"))
            grew = [pid for pid in ingress if after[pid] > before[pid]]
            assert len(grew) == 1, (before, after)
            holder[grew[0]].append(i)
            assert response.model_name == "tiny_onnx" and response.outputs[0].shape == [1, 3]
            answers.add(response.raw_output_contents[0])
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30)
            assert [(m.name, m.state) for m in index.models] == [("tiny_onnx", "READY")]
            metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny_onnx"), timeout=30)
            assert [t.name for t in metadata.inputs] == ["x"]
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
        assert len(answers) == CHANNELS  # each input got its own answer
        assert all(holder[pid] for pid in ingress), holder  # both ingress processes answered

        # A repository load through a connection of each ingress (a reload keeps serving).
        for pid in ingress:
            stub = stubs[holder[pid][0]]
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="tiny_onnx"), metadata=ADMIN,
                                     timeout=60)
            assert stub.ModelReady(pb.ModelReadyRequest(name="tiny_onnx"), timeout=30).ready
            assert stub.ModelInfer(infer_request(1.0), timeout=30).model_name == "tiny_onnx"
        with pytest.raises(grpc.RpcError) as missing:
            stubs[0].ModelReady(pb.ModelReadyRequest(name="nope"), timeout=30)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as refused:
            stubs[1].RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="tiny_onnx"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the admin token is checked in the ingress
    finally:
        for channel in channels:
            channel.close()


def test_a_second_server_on_the_grpc_port_fails_instead_of_sharing_it(split_server, start_module_server,
                                                                       tmp_path):
    # SO_REUSEPORT would let it bind beside the first one's ingress processes and take a share of
    # their clients; the supervisor checks the port first and stops, as on a busy HTTP port.
    second = start_module_server(["--model-repository", str(tmp_path), "--grpc-port", str(split_server.grpc_port),
                                  "--ingress-processes", "1"])
    assert second.proc.wait(60) == 1, second.log()[-3000:]
    assert "address already in use" in second.log() and str(split_server.grpc_port) in second.log()
    with grpc.insecure_channel(split_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelInfer(infer_request(1.0), timeout=30).model_name == "tiny_onnx"


def grpc_listeners(server) -> tuple[set[int], set[int]]:
    """(pids listening on the gRPC port, ingress pids) of a split server now."""
    pids = children(server.proc.pid)
    listening = owners([*pids, server.proc.pid], sockets_on_port(server.grpc_port, "0A"))
    return {pid for pid, count in listening.items() if count}, {pid for pid in pids if role_of(pid) == "ingress"}


def test_an_ingress_killed_comes_back_on_the_grpc_port_and_the_other_serves_meanwhile(split_server):
    listening, ingress = grpc_listeners(split_server)
    assert listening == ingress and len(ingress) == 2
    victim = min(ingress)
    os.kill(victim, signal.SIGKILL)

    def back() -> bool:
        now_listening, now_ingress = grpc_listeners(split_server)
        return victim not in now_ingress and len(now_ingress) == 2 and now_listening == now_ingress
    eventually(back, 60, lambda: f"the restarted ingress does not listen on the gRPC port: "
               f"{grpc_listeners(split_server)}\n{split_server.log()[-3000:]}")
    # every new connection is served, whichever ingress (the restarted one bound beside the other)
    for _ in range(CHANNELS):
        with grpc.insecure_channel(split_server.grpc_url, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ModelInfer(infer_request(2.0), timeout=30).model_name == "tiny_onnx"
            assert stub.ModelReady(pb.ModelReadyRequest(name="tiny_onnx"), timeout=30).ready
