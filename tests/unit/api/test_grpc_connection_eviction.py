"""The gRPC connection sweep's policy (issue 45 H18): which connections give way to new ones."""

from __future__ import annotations

from servewell.api.grpc.connection_eviction import CallPeers, OpenConnection, eviction_victims, peer_address


def conns(*ports: int) -> list[OpenConnection]:
    return [OpenConnection(("127.0.0.1", port), float(since)) for since, port in enumerate(ports)]


def test_peer_strings_of_grpc_and_of_channelz_name_the_kernel_address():
    assert peer_address("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert peer_address("ipv6:[::1]:5000") == ("::1", 5000)
    assert peer_address("ipv6:%5B::1%5D:5000") == ("::1", 5000)
    assert peer_address("ipv6:[::ffff:127.0.0.1]:5000") == ("127.0.0.1", 5000)
    assert peer_address("ipv6:[fe80::1%25eth0]:5000") == ("fe80::1", 5000)
    assert peer_address("unix:/tmp/sock") is None
    assert peer_address("ipv4:127.0.0.1") is None


def test_nothing_is_closed_while_there_is_room():
    assert eviction_victims(conns(1, 2, 3), CallPeers(), keep=3, now=100.0, min_idle_s=5.0) == []


def test_connections_that_never_called_go_first_oldest_first():
    calls = CallPeers()
    calls.started(("127.0.0.1", 1))  # the oldest has a call open: never closed
    calls.ended(("127.0.0.1", 2), 0.0)  # not started: ignored
    connections = [OpenConnection(("127.0.0.1", 4), 9.0), *conns(1, 2, 3)]
    assert eviction_victims(connections, calls, keep=2, now=100.0, min_idle_s=5.0) == [
        ("127.0.0.1", 2), ("127.0.0.1", 3)]


def test_then_the_longest_idle_but_never_one_with_a_call_open_or_one_idle_briefly():
    calls = CallPeers()
    for port in (1, 2, 3, 4):
        calls.started(("127.0.0.1", port))
    calls.ended(("127.0.0.1", 2), 50.0)
    calls.ended(("127.0.0.1", 3), 10.0)
    calls.ended(("127.0.0.1", 4), 98.0)  # idle 2 s only
    victims = eviction_victims(conns(1, 2, 3, 4, 5), calls, keep=1, now=100.0, min_idle_s=5.0)
    assert victims == [("127.0.0.1", 5), ("127.0.0.1", 3), ("127.0.0.1", 2)]


def test_a_connection_with_two_calls_is_busy_until_both_end():
    calls, address = CallPeers(), ("127.0.0.1", 1)
    calls.started(address)
    calls.started(address)
    calls.ended(address, 1.0)
    assert calls.in_flight(address) == 1 and calls.idle_since(address) is None
    calls.ended(address, 2.0)
    assert calls.idle_since(address) == 2.0
    assert eviction_victims(conns(1), calls, keep=0, now=10.0, min_idle_s=5.0) == [address]


def test_closed_connections_are_forgotten_so_a_reused_address_counts_as_new():
    calls = CallPeers()
    calls.started(("127.0.0.1", 1))
    calls.ended(("127.0.0.1", 1), 1.0)
    calls.started(("127.0.0.1", 2))  # still in flight: kept even though its connection is not listed
    calls.forget_all_but([("127.0.0.1", 3)])
    assert not calls.has_called(("127.0.0.1", 1)) and calls.has_called(("127.0.0.1", 2))
    assert len(calls) == 1
