"""The sweep that keeps room for new gRPC connections under the cap (the policy:
`connection_eviction.py`), and the gRPC port's connections as this process's sockets.

grpc core accepts the port's connections itself and gives Python no hook per connection, so the
sweep reads them where the kernel keeps them: this process's TCP sockets whose local port is the
gRPC port (found through /proc/self/fd), each known by its remote address, aged from the sweep
that first saw it. A connection is closed by `shutdown()` on its socket: grpc core sees the peer's
end as for any closed connection and frees its place (measured: within 0.1 s). The socket is shut
down through a duplicate descriptor, checked after duplication, so a descriptor number grpc core
closed and reused meanwhile can never be hit.

Connections still in their HTTP/2 handshake count too: grpc core counts them against the cap from
accept, and 30 connections that sent nothing held a cap of 30 for the whole handshake timeout.

Cost: a scan looks at every descriptor of the process, on a thread: 82 ms for 2,000 descriptors
on this 2-core VM at load 17, where plain Python ran about 10x slower than when quiet (so about
4 us a descriptor when quiet); a sweep every second while the port is quiet, every 0.25 s while
more than half the kept connections are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping

from servewell.api.grpc.connection_eviction import Address, CallPeers, OpenConnection, eviction_victims, normal_host

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


def _inet_stream(fd: int) -> socket.socket | None:
    """A duplicate of descriptor `fd` if it is a TCP socket (the caller closes it), else None."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return None  # closed since listed (the listing's own descriptor, too)
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)  # not a socket
        return None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.close()
        return None
    return sock


def _addresses(sock: socket.socket) -> tuple[int, Address] | None:
    """(local port, remote address) of a connected socket, None for a listening one."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    return int(local[1]), (normal_host(str(peer[0])), int(peer[1]))


class PortConnections:
    """The connections this process holds on `local_port`, as the kernel sees them."""

    def __init__(self, local_port: int) -> None:
        self.local_port = local_port

    def scan(self) -> dict[Address, int]:
        """Each connection to the port: its remote address -> its descriptor number now."""
        found: dict[Address, int] = {}
        for name in os.listdir("/proc/self/fd"):
            sock = _inet_stream(int(name))
            if sock is None:
                continue
            with sock:
                addresses = _addresses(sock)
            if addresses is not None and addresses[0] == self.local_port:
                found[addresses[1]] = int(name)
        return found

    def close(self, victims: Mapping[Address, int]) -> int:
        """Shut down each connection of `victims` (address -> descriptor from `scan`) that is still
        that connection; how many were."""
        closed = 0
        for address, fd in victims.items():
            sock = _inet_stream(fd)
            if sock is None:
                continue
            with sock:
                if _addresses(sock) != (self.local_port, address):
                    continue  # gone, and its descriptor number reused meanwhile
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
        return closed


class ConnectionSweeper:
    """Keeps room for new gRPC connections under the cap: every sweep closes the surplus over
    `keep` (see `connection_eviction.py`). `calls` is filled by the router."""

    def __init__(self, connections: PortConnections, calls: CallPeers, cap: int) -> None:
        self._connections = connections
        self._calls = calls
        self.keep = max(1, int(cap * KEEP_SHARE))
        self._seen_at: dict[Address, float] = {}
        #: Connections closed since start to keep room.
        self.evicted = 0
        self._warned_at = -WARN_EVERY_S
        self._unwarned = 0

    def sweep(self, now: float) -> int:
        """One sweep at once: close the surplus; how many connections were open (before closing)."""
        found = self._connections.scan()
        victims = self.choose(found, now)
        if victims:
            self.closed(self._connections.close(victims), len(found), now)
        return len(found)

    def choose(self, found: Mapping[Address, int], now: float) -> dict[Address, int]:
        """The connections of a `scan` to close (address -> descriptor): the surplus over `keep`."""
        self._seen_at = {address: self._seen_at.get(address, now) for address in found}
        self._calls.forget_all_but(found)
        connections = [OpenConnection(address, since) for address, since in self._seen_at.items()]
        return {address: found[address]
                for address in eviction_victims(connections, self._calls, self.keep, now, MIN_IDLE_S)}

    def closed(self, count: int, open_count: int, now: float) -> None:
        """`count` connections were closed of `open_count`: counted, and said at most once a minute."""
        self.evicted += count
        self._unwarned += count
        if count and now - self._warned_at >= WARN_EVERY_S:
            log.warning("gRPC: closed %d connections without a call open (oldest first) to keep room for new ones: "
                        "%d were open, %d are kept (75 %% of grpc_max_connections)", self._unwarned, open_count,
                        self.keep)
            self._warned_at, self._unwarned = now, 0

    async def run(self) -> None:
        """Sweep until cancelled: every `FAST_SWEEP_S` while more than half of `keep` is open, else
        every `SLOW_SWEEP_S`. The scan and the shutdowns run on a thread (a flood's 3,000 descriptors
        are tens of ms of system calls, which the ingress's requests must not wait behind); the choice
        runs on the loop, beside the router that counts the calls."""
        delay_s = SLOW_SWEEP_S
        while True:
            await asyncio.sleep(delay_s)
            try:
                found = await asyncio.to_thread(self._connections.scan)
                victims = self.choose(found, time.monotonic())
                if victims:
                    closed = await asyncio.to_thread(self._connections.close, victims)
                    self.closed(closed, len(found), time.monotonic())
                open_now = len(found)
            except Exception:  # a sweep must never end the listener; the next one tries again
                log.exception("gRPC connection sweep failed")
                open_now = 0
            delay_s = FAST_SWEEP_S if open_now > self.keep // 2 else SLOW_SWEEP_S
