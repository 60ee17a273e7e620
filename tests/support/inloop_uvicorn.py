"""A real uvicorn server inside the test's own event loop: on a unix socket or a TCP port of
127.0.0.1, started and stopped in well under a second, with a count of the connections it accepted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass
class Served:
    """A running server: its uvicorn object, its TCP port (0 on a unix socket) and the connections
    accepted so far."""

    server: uvicorn.Server
    port: int
    accepted: list[int] = field(default_factory=lambda: [0])

    @property
    def connections_accepted(self) -> int:
        return self.accepted[0]

    @property
    def connections_open(self) -> int:
        return len(self.server.server_state.connections)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, *, uds: str | None = None, **options: Any) -> AsyncIterator[Served]:
    """Serve `app` on the unix socket `uds`, or (without) on a free TCP port of 127.0.0.1, until the block ends."""
    accepted = [0]
    options.setdefault("timeout_graceful_shutdown", 2)  # a test that left a stream open still ends

    class CountingProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            accepted[0] += 1
            super().connection_made(transport)

    config = uvicorn.Config(app, uds=uds, lifespan="off", log_config=None, access_log=False,
                            http=CountingProtocol, **options)
    server = uvicorn.Server(config)
    sockets = None
    port = 0
    if uds is None:
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose `proto` says TCP,
        # and without it every answer written as head + body waited 40 ms for a delayed ACK.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        sockets = [listener]
    task = asyncio.ensure_future(server.serve(sockets=sockets))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.002)
        yield Served(server, port, accepted)
    finally:
        stop(server)
        await task


def stop(server: uvicorn.Server) -> None:
    """Ask `server` to stop without waiting for its connections (a test's teardown; call it on
    several servers before their blocks end, and they stop together)."""
    server.should_exit = server.force_exit = True
