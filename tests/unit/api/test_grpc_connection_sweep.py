"""The gRPC connection sweep on real sockets of this process (issue 45 H18): it finds the port's
connections by their remote address and shuts down the surplus, never one with a call open."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from servewell.api.grpc.connection_eviction import CallPeers
from servewell.api.grpc.connection_sweep import ConnectionSweeper, PortConnections


class Pairs:
    """A listening socket and the connections made to it: (client side, server side) pairs."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []

    def connect(self) -> tuple[str, int]:
        client = socket.create_connection(("127.0.0.1", self.port))
        server, _ = self.listener.accept()
        self.pairs.append((client, server))
        host, port = client.getsockname()[:2]
        return str(host), int(port)

    def ended_by_server(self, index: int) -> bool:
        client = self.pairs[index][0]
        client.settimeout(0.02)  # a shutdown's end arrives at once: same process, loopback
        try:
            return client.recv(1) == b""
        except TimeoutError:
            return False

    def close(self) -> None:
        for client, server in self.pairs:
            client.close()
            server.close()
        self.listener.close()


@pytest.fixture
def pairs() -> Iterator[Pairs]:
    made = Pairs()
    yield made
    made.close()


def test_the_ports_connections_are_found_by_remote_address_and_one_is_shut_down(pairs):
    addresses = [pairs.connect() for _ in range(3)]
    connections = PortConnections(pairs.port)
    found = connections.scan()
    assert sorted(found) == sorted(addresses)  # the server sides only: not the clients, not the listener
    assert connections.close({addresses[1]: found[addresses[1]]}) == 1
    assert pairs.ended_by_server(1) and not pairs.ended_by_server(0) and not pairs.ended_by_server(2)


def test_a_stale_descriptor_number_is_never_shut_down(pairs):
    addresses = [pairs.connect() for _ in range(2)]
    connections = PortConnections(pairs.port)
    found = connections.scan()
    # The first connection's descriptor number, as if it now held the second connection.
    assert connections.close({addresses[1]: found[addresses[0]]}) == 0
    assert not pairs.ended_by_server(0) and not pairs.ended_by_server(1)


def test_the_sweep_closes_the_oldest_connections_without_a_call_down_to_three_quarters_of_the_cap(pairs):
    calls = CallPeers()
    sweeper = ConnectionSweeper(PortConnections(pairs.port), calls, cap=4)  # keeps 3
    old = [pairs.connect() for _ in range(3)]
    calls.started(old[0])  # the oldest has a call in flight
    assert sweeper.sweep(now=10.0) == 3 and sweeper.evicted == 0
    for _ in range(2):
        pairs.connect()
    assert sweeper.sweep(now=11.0) == 5
    assert sweeper.evicted == 2
    assert [pairs.ended_by_server(i) for i in range(5)] == [False, True, True, False, False]
