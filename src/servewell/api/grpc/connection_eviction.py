"""Which gRPC connections give way to new ones: the policy, pure and synchronous (no sockets, no
clock), as `api/connection_slots.py` is for HTTP.

grpc core keeps the gRPC port's connection cap itself (`grpc.max_allowed_incoming_connections`)
and closes every connection that arrives at the cap. 3,000 connections that sent an HTTP/2 preface
and SETTINGS and nothing more held all 1,000 places, and a real `tritonclient.grpc` client failed
at once (UNAVAILABLE "Socket closed") until the idle timeout ended them, which an attacker renews.
So the listener keeps room: once more than `keep` connections are open, the surplus is closed,
in this order:

1. connections that never opened a call, oldest first, whether they finished their HTTP/2
   handshake or sent nothing at all (an attacker's are older than a real client's, whose first
   call follows its connection within milliseconds);
2. then connections with no call open whose last call ended at least `min_idle_s` ago, the longest
   idle first (closing an idle connection is ordinary HTTP/2: the client reconnects for its next
   call);

never a connection with a call in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

#: A connection's remote address as the kernel names it: (host, port).
Address = tuple[str, int]


def peer_address(peer: str) -> Address | None:
    """The (host, port) of a grpc peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, also
    percent-encoded as `ipv6:%5B::1%5D:5000`); an IPv4-mapped IPv6 host as its IPv4 form; None for
    any other kind of peer (unix sockets)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None
    return normal_host(host.strip("[]")), int(port)


def normal_host(host: str) -> str:
    """`host` without an IPv6 scope or IPv4-mapped prefix, as grpc core's dual-stack sockets report
    IPv4 peers (`::ffff:127.0.0.1`)."""
    host = host.partition("%")[0]
    return host[7:] if host.lower().startswith("::ffff:") and "." in host else host


@dataclass(frozen=True, slots=True)
class OpenConnection:
    """One connection grpc core holds open (its HTTP/2 handshake done or not)."""

    address: Address
    #: When it was first seen open (lower is older).
    since: float


class _Calls:
    __slots__ = ("in_flight", "last_ended_at")

    def __init__(self) -> None:
        self.in_flight = 0
        self.last_ended_at: float | None = None


class CallPeers:
    """The calls of each connection, by its remote address: how many are in flight and when the
    last one ended (the router tells it; the sweep reads it)."""

    def __init__(self) -> None:
        self._calls: dict[Address, _Calls] = {}

    def started(self, address: Address) -> None:
        """A call began on the connection from `address`."""
        calls = self._calls.get(address)
        if calls is None:
            calls = self._calls[address] = _Calls()
        calls.in_flight += 1

    def ended(self, address: Address, now: float) -> None:
        """A call that `started` on `address` ended at `now`."""
        calls = self._calls.get(address)
        if calls is not None:
            calls.in_flight = max(0, calls.in_flight - 1)
            calls.last_ended_at = now

    def has_called(self, address: Address) -> bool:
        """Whether the connection from `address` ever opened a call."""
        return address in self._calls

    def in_flight(self, address: Address) -> int:
        """Calls open now on the connection from `address`."""
        calls = self._calls.get(address)
        return 0 if calls is None else calls.in_flight

    def idle_since(self, address: Address) -> float | None:
        """When the connection's last call ended, if it has none open now (else None)."""
        calls = self._calls.get(address)
        if calls is None or calls.in_flight or calls.last_ended_at is None:
            return None
        return calls.last_ended_at

    def forget_all_but(self, open_addresses: Iterable[Address]) -> None:
        """Drop what is known of connections that closed (a new connection may reuse the address);
        ones with a call in flight are kept, since their call will still end."""
        keep = set(open_addresses)
        for address in [a for a, calls in self._calls.items() if a not in keep and not calls.in_flight]:
            del self._calls[address]

    def __len__(self) -> int:
        return len(self._calls)


def eviction_victims(connections: Sequence[OpenConnection], calls: CallPeers, keep: int, now: float,
                     min_idle_s: float) -> list[Address]:
    """The addresses of the connections to close so that at most `keep` stay open (fewer when too
    few may be closed): see the module doc for the order."""
    excess = len(connections) - keep
    if excess <= 0:
        return []
    oldest_first = sorted(connections, key=lambda c: c.since)
    victims = [c.address for c in oldest_first if not calls.has_called(c.address)][:excess]
    if len(victims) < excess:
        idle: list[tuple[float, Address]] = []
        for connection in oldest_first:
            since = calls.idle_since(connection.address)
            if since is not None and now - since >= min_idle_s:
                idle.append((since, connection.address))
        idle.sort()
        victims += [address for _, address in idle[: excess - len(victims)]]
    return victims
