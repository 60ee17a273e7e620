"""grpc core's connections of one gRPC server, seen and closed from Python, and the sweep that
keeps room under the connection cap (the policy: `connection_eviction.py`).

grpcio gives no hook per connection, so the sweep reads grpc core's channelz registry (on by
default; the calls `grpcio-channelz`'s servicer makes, without its protobuf round trip) for the
server's open connections in the order they were created, and closes one by `shutdown()` on its
socket, found among this process's descriptors by its local port and remote address: grpc core
sees the peer's end as for any closed connection and frees its place (measured: within 0.1 s).
The socket is shut down through a duplicate descriptor, checked after duplication, so a
descriptor number grpc core closed and reused meanwhile can never be hit.

Measured (2-core VM): listing 1,000 connections costs about 3 ms; finding descriptors about
5 us per open descriptor, paid only by a sweep that closes something.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import socket
import time
from collections.abc import Collection, Iterator
from typing import Any

from servewell.api.grpc.connection_eviction import (
    Address,
    CallPeers,
    OpenConnection,
    eviction_victims,
    normal_host,
    peer_address,
)

log = logging.getLogger("servewell.api")



#: Connections kept once the sweep closes some: this share of the cap, so a quarter of the cap is
#: room for new connections between two sweeps (a flood opening 1,000 a second fills 250 places
#: in the 0.25 s between fast sweeps).
KEEP_SHARE = 0.75
#: Seconds between sweeps while more than half of `keep` is open, and otherwise.
FAST_SWEEP_S = 0.25
SLOW_SWEEP_S = 1.0
#: A connection whose calls all ended is closed only after this long without one.
MIN_IDLE_S = 5.0
#: Seconds between two warnings that connections were closed.
WARN_EVERY_S = 60.0


def _channelz(name: str) -> Any:
    """One of grpcio's channelz functions (what grpcio-channelz's servicer calls), or None if a
    grpcio release moved it: then nothing is swept, as before the sweep existed."""
    try:
        cygrpc = importlib.import_module("grpc._cython.cygrpc")
    except ImportError:
        return None
    return getattr(cygrpc, name, None)


def server_ids() -> set[int]:
    """The ids of this process's gRPC servers in channelz (empty when channelz is unavailable)."""
    get_servers = _channelz("channelz_get_servers")
    if get_servers is None:
        return set()
    ids: set[int] = set()
    start = 0
    while True:
        page = json.loads(get_servers(start))
        for server in page.get("server", []):
            ids.add(int(server["ref"]["serverId"]))
        if page.get("end", True) or not page.get("server"):
            return ids
        start = max(ids) + 1


class CoreConnections:
    """The connections of one grpc core server (its channelz id), served on `local_port`."""

    def __init__(self, server_id: int, local_port: int) -> None:
        self.server_id = server_id
        self.local_port = local_port

    def open(self) -> list[OpenConnection]:
        """The server's open connections (after their HTTP/2 handshake), oldest first."""
        get_sockets = _channelz("channelz_get_server_sockets")
        if get_sockets is None:
            return []
        found: list[OpenConnection] = []
        start = 0
        while True:
            page = json.loads(get_sockets(self.server_id, start, 0))
            refs = page.get("socketRef", [])
            for ref in refs:
                # "chttp2 ipv4:127.0.0.1:5000": the transport, then its peer
                address = peer_address(ref.get("name", "").rpartition(" ")[2])
                if address is not None:
                    found.append(OpenConnection(address, int(ref["socketId"])))
            if page.get("end", True) or not refs:
                break
            start = int(refs[-1]["socketId"]) + 1
        found.sort(key=lambda c: c.order)
        return found

    def close(self, addresses: Collection[Address]) -> int:
        """Shut down the connections from `addresses` to this server's port; how many were found."""
        wanted = set(addresses)
        closed = 0
        for sock in self._sockets():
            with sock:
                try:
                    local, peer = sock.getsockname(), sock.getpeername()
                except OSError:
                    continue
                if local[1] != self.local_port or (normal_host(peer[0]), peer[1]) not in wanted:
                    continue
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
        return closed

    @staticmethod
    def _sockets() -> Iterator[socket.socket]:
        """A duplicate of each of this process's TCP sockets (the caller closes each)."""
        for name in os.listdir("/proc/self/fd"):
            try:
                duplicate = os.dup(int(name))
            except OSError:
                continue  # closed since listed (the listing's own descriptor, too)
            try:
                sock = socket.socket(fileno=duplicate)
            except OSError:
                os.close(duplicate)  # not a socket
                continue
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                sock.close()
                continue
            yield sock


class ConnectionSweeper:
    """Keeps room for new gRPC connections under the cap: every sweep closes the surplus over
    `keep` (see `connection_eviction.py`). `calls` is filled by the router."""

    def __init__(self, connections: CoreConnections, calls: CallPeers, cap: int) -> None:
        self._connections = connections
        self._calls = calls
        self.keep = max(1, int(cap * KEEP_SHARE))
        #: Connections closed since start to keep room.
        self.evicted = 0
        self._warned_at = -WARN_EVERY_S
        self._unwarned = 0

    def sweep(self, now: float) -> int:
        """One sweep: close the surplus; how many connections are open now (before closing)."""
        connections = self._connections.open()
        self._calls.forget_all_but(c.address for c in connections)
        victims = eviction_victims(connections, self._calls, self.keep, now, MIN_IDLE_S)
        if victims:
            closed = self._connections.close(victims)
            self.evicted += closed
            self._unwarned += closed
            if now - self._warned_at >= WARN_EVERY_S:
                log.warning("gRPC: closed %d connections without a call open (oldest first) to keep room for new "
                            "ones: %d were open, %d are kept (75 %% of grpc_max_connections)",
                            self._unwarned, len(connections), self.keep)
                self._warned_at, self._unwarned = now, 0
        return len(connections)

    async def run(self) -> None:
        """Sweep until cancelled: every `FAST_SWEEP_S` while more than half of `keep` is open, else
        every `SLOW_SWEEP_S`."""
        delay_s = SLOW_SWEEP_S
        while True:
            await asyncio.sleep(delay_s)
            try:
                open_now = self.sweep(time.monotonic())
            except Exception:  # a sweep must never end the listener; the next one tries again
                log.exception("gRPC connection sweep failed")
                open_now = 0
            delay_s = FAST_SWEEP_S if open_now > self.keep // 2 else SLOW_SWEEP_S
