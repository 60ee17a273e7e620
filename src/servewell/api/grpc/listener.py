"""The gRPC listener: a `grpc.aio` server on the frontend's event loop, with the transport bounds
grpc core enforces itself (connections, streams per connection, handshake, idle and age limits,
keepalive ping policy) so that the gRPC port can never take the descriptors HTTP and probes need.

Measured before these bounds: 20,000 connections that sent only the HTTP/2 preface and SETTINGS
took the process to its open-files limit (HTTP probes reset, RSS 117 -> 414 MB). With the cap
alone, 3,000 such connections held every place and a new client failed at once; so a sweep
(`connection_sweep.py`) closes the connections that never opened a call, oldest first, to keep a
quarter of the cap free for new ones.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from servewell.api.grpc.connection_eviction import CallPeers
from servewell.api.grpc.connection_sweep import ConnectionSweeper, PortConnections
from servewell.api.grpc.limits import CallSlots, backstop_rpcs, grpc_connection_cap, raise_open_files_limit
from servewell.api.grpc.routing import ServiceRouter
from servewell.api.grpc.scope import RpcScope
from servewell.api.grpc.servicer import InferenceServicer
from servewell.config.server import ServerConfig

log = logging.getLogger("servewell.api")


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    """The transport bounds of the gRPC listener (see `ServerConfig`'s grpc_* fields)."""

    max_message_bytes: int
    max_concurrent_rpcs: int
    max_connections: int
    max_streams_per_connection: int
    handshake_timeout_s: float
    idle_timeout_s: float
    max_connection_age_s: float
    connection_age_grace_s: float
    min_ping_interval_s: float
    #: Descriptors HTTP may use (its connections and reserved ones) plus the fd reserve.
    descriptors_kept: int


def grpc_limits(settings: ServerConfig) -> GrpcLimits:
    """The gRPC listener's bounds from the server settings."""
    return GrpcLimits(
        max_message_bytes=settings.max_body_bytes, max_concurrent_rpcs=settings.grpc_max_concurrent_rpcs,
        max_connections=settings.grpc_max_connections,
        max_streams_per_connection=settings.grpc_max_streams_per_connection,
        handshake_timeout_s=settings.grpc_handshake_timeout_s, idle_timeout_s=settings.grpc_idle_timeout_s,
        max_connection_age_s=settings.grpc_max_connection_age_s,
        connection_age_grace_s=settings.grpc_connection_age_grace_s,
        min_ping_interval_s=settings.grpc_min_ping_interval_s,
        descriptors_kept=settings.max_connections + settings.reserved_connections + settings.fd_reserve,
    )


def build_grpc_listener(settings: ServerConfig, servicer: InferenceServicer, scope: RpcScope, *,
                        reuse_port: bool = False) -> GrpcListener:
    """The gRPC listener serving `servicer` within the settings' limits. `reuse_port`: this is one
    of several ingress processes sharing the port (SO_REUSEPORT: the kernel spreads connections
    across them); otherwise a second server on the port fails to bind."""
    router = ServiceRouter(servicer, scope, settings.grpc_receive_timeout_s, CallPeers())
    return GrpcListener(router, settings.host, settings.grpc_port, grpc_limits(settings), reuse_port=reuse_port)


def call_slots(settings: ServerConfig) -> CallSlots:
    """The gRPC calls served at once (`grpc_max_concurrent_rpcs`)."""
    return CallSlots(settings.grpc_max_concurrent_rpcs)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def channel_options(limits: GrpcLimits, connection_cap: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    """grpc core channel arguments for `limits` (names as in grpc's `grpc_types.h`); `reuse_port`
    sets SO_REUSEPORT (grpc's default on Linux, so always said explicitly)."""
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", -1),
        # One process: a second server on the same port must fail, not share it. Ingress processes
        # of a split server: every one binds the port and the kernel spreads connections across them.
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_allowed_incoming_connections", connection_cap),
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
        ("grpc.server_handshake_timeout_ms", _ms(limits.handshake_timeout_s)),
        ("grpc.http2.settings_timeout", _ms(limits.handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", _ms(limits.idle_timeout_s)),
        ("grpc.max_connection_age_ms", _ms(limits.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", _ms(limits.connection_age_grace_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(limits.min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", 2),
    ]


class GrpcListener:
    """Serves `InferenceServicer` (through `ServiceRouter`) on `host:port` until stopped."""

    def __init__(self, router: ServiceRouter, host: str, port: int, limits: GrpcLimits, *,
                 reuse_port: bool = False) -> None:
        self._router = router
        self._reuse_port = reuse_port
        self._address = f"{host}:{port}"
        self._limits = limits
        self._server: grpc.aio.Server | None = None
        self._sweeper: ConnectionSweeper | None = None
        self._sweeping: asyncio.Task[None] | None = None
        self.connection_cap = limits.max_connections

    @property
    def evicted(self) -> int:
        """Connections closed since start to keep room for new ones (none without a sweep)."""
        return 0 if self._sweeper is None else self._sweeper.evicted

    async def start(self) -> None:
        """Bind and start serving; `OSError` when the port cannot be bound."""
        limits = self._limits
        open_files = raise_open_files_limit()
        self.connection_cap = grpc_connection_cap(limits.max_connections, open_files, limits.descriptors_kept, 0)
        if self.connection_cap < limits.max_connections:
            log.warning("gRPC connections capped at %d (not %d): the open-files limit is %d and HTTP and the fd "
                        "reserve keep %d", self.connection_cap, limits.max_connections, open_files,
                        limits.descriptors_kept)
        server = grpc.aio.server(
            options=channel_options(limits, self.connection_cap, self._reuse_port),
            maximum_concurrent_rpcs=backstop_rpcs(self.connection_cap, limits.max_streams_per_connection,
                                                  limits.max_concurrent_rpcs),
        )
        server.add_generic_rpc_handlers((self._router,))
        try:
            bound = server.add_insecure_port(self._address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {self._address}: {exc}") from None
        if not bound:
            raise OSError(f"cannot listen for gRPC on {self._address} (in use?); set --grpc-port, or 0 to turn it off")
        await server.start()
        self._server = server
        self._sweeper = ConnectionSweeper(PortConnections(bound), self._router.calls, self.connection_cap)
        self._sweeping = asyncio.get_running_loop().create_task(self._sweeper.run())
        log.info("gRPC (OIP v2) listening on %s (at most %d connections)", self._address, self.connection_cap)

    async def stop(self, grace_s: float) -> None:
        """Send every connection GOAWAY and refuse new ones at once; calls in flight get `grace_s`
        seconds to finish."""
        if self._sweeping is not None:
            self._sweeping.cancel()
            self._sweeping = None
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace_s)
