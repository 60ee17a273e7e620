"""Bounds of the gRPC port that grpcio does not keep by itself: how many connections fit beside
HTTP under the open-files limit, and how many calls run at once once their message is in.

grpcio's own `maximum_concurrent_rpcs` counts a call from its headers: 1,100 calls whose request
message never completed (11 connections, 17 KB sent in all) held every slot and refused every
legitimate call for the whole 45 s hold. `CallSlots` is taken only after the message has arrived
and the key was checked; grpcio's limit stays as a much higher backstop (`backstop_rpcs`).
"""

from __future__ import annotations

import resource

from servewell.api.fd_limits import raise_fd_limit

#: The least gRPC connections the listener keeps, however tight the open-files limit.
MIN_GRPC_CONNECTIONS = 8
#: What "the hard limit" is when it is unlimited (macOS): the soft limit is raised this far.
UNLIMITED_OPEN_FILES = 1_048_576


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (never down; `UNLIMITED_OPEN_FILES`
    when the hard limit is unlimited); the soft limit now."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return raise_fd_limit(UNLIMITED_OPEN_FILES if hard == resource.RLIM_INFINITY else hard)


def grpc_connection_cap(wanted: int, open_files: int, http_connections: int, reserve: int) -> int:
    """The gRPC connection cap: `wanted`, lowered so that HTTP's connections and `reserve` always
    fit under `open_files` (never below `MIN_GRPC_CONNECTIONS` unless `wanted` is)."""
    room = open_files - http_connections - reserve
    return min(wanted, max(MIN_GRPC_CONNECTIONS, room))


def backstop_rpcs(connections: int, streams_per_connection: int, call_slots: int) -> int:
    """grpcio's own concurrency limit: every stream the connection limits allow, so that it only
    refuses what the transport limits already bound (and never fewer than the call slots)."""
    return max(call_slots, connections * streams_per_connection)


class CallSlots:
    """Calls served at once: a slot is taken when a call's message is in and its key checked, and
    given back when the call ends; none free means the call is refused at once."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"at least one call slot is needed, got {limit}")
        self.limit = limit
        self._taken = 0

    @property
    def taken(self) -> int:
        """Slots held now."""
        return self._taken

    def try_take(self) -> bool:
        """Take a slot; False when all are held."""
        if self._taken >= self.limit:
            return False
        self._taken += 1
        return True

    def give_back(self) -> None:
        """Return a slot taken with `try_take`."""
        if self._taken <= 0:
            raise RuntimeError("a call slot was given back that was never taken")
        self._taken -= 1
