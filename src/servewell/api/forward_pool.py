"""Keep-alive HTTP/1.1 connections to the engine's private unix socket, for `api/forward.py`.

`UpstreamConnection` is one socket with an h11 client state machine: every read and every wait
for the engine to take bytes is bounded by `io_timeout_s`, and the response head by
`max_header_bytes`. `UpstreamPool` hands out at most `max_connections` of them at a time,
reusing idle ones (most recently used first) and opening new ones on demand.

An idle connection is handed out again only when it is still fresh: the engine did not close
it (uvicorn closes a keep-alive connection after `timeout_keep_alive`, 5 s by default, and the
end of file is seen here as soon as it arrives) and it has been idle less than
`idle_timeout_s`, which stays below the engine's keep-alive timeout so that a request is
rarely written into a socket the engine is closing at that moment (the caller retries the
rare one that is, when it may: see `api/forward.py`).
"""

from __future__ import annotations

import asyncio
import time

import h11

#: Largest read from the engine's socket at once.
READ_CHUNK_BYTES = 64 * 1024


class UpstreamError(Exception):
    """The engine could not be reached or did not answer properly; `str()` says how."""


class UpstreamConnection:
    """One HTTP/1.1 connection to the engine. Not for sharing: one exchange at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 io_timeout_s: float, max_header_bytes: int) -> None:
        self._reader = reader
        self._writer = writer
        #: Longest wait for one read from, or one drain to, the engine.
        self.io_timeout_s = io_timeout_s
        #: Largest answer head accepted (h11 bounds only a head still incomplete after a read,
        #: so a whole head read at once is measured by the caller).
        self.max_header_bytes = max_header_bytes
        self.protocol = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_header_bytes)
        #: Whether this connection already carried an exchange (so the engine may have closed it).
        self.reused = False
        #: `time.monotonic()` seconds when it was last returned to the pool.
        self.idle_since = 0.0

    @property
    def fresh(self) -> bool:
        """Whether it may carry another exchange: idle in h11's eyes and not closed by either side."""
        return (self.protocol.our_state is h11.IDLE and not self._reader.at_eof()
                and not self._writer.transport.is_closing())

    async def send(self, event: h11.Event) -> None:
        """Write `event` (a request head, a body chunk, its end) and wait, at most `io_timeout_s`,
        until the engine has taken enough of what is buffered: back-pressure, not buffering."""
        data = self.protocol.send(event)
        if data:
            self._writer.write(data)
            async with asyncio.timeout(self.io_timeout_s):
                await self._writer.drain()

    async def read(self) -> None:
        """Read what the engine sent next (waiting at most `io_timeout_s`) into the h11 state
        machine; at end of file h11 is told so, and its next event says what that means."""
        async with asyncio.timeout(self.io_timeout_s):
            data = await self._reader.read(READ_CHUNK_BYTES)
        self.protocol.receive_data(data)

    @property
    def reusable(self) -> bool:
        """Whether the exchange ended cleanly on both sides, the engine allowed keep-alive and
        nobody closed the socket since."""
        return (self.protocol.our_state is h11.DONE and self.protocol.their_state is h11.DONE
                and not self._writer.transport.is_closing())

    def close(self) -> None:
        """Close the socket at once (unsent bytes are dropped: the exchange is abandoned)."""
        self._writer.transport.abort()


class UpstreamPool:
    """At most `max_connections` connections to the unix socket at `path`, kept alive between exchanges."""

    def __init__(self, path: str, *, max_connections: int, pool_timeout_s: float, connect_timeout_s: float,
                 idle_timeout_s: float, io_timeout_s: float, max_header_bytes: int) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.path = path
        self.max_connections = max_connections
        self._pool_timeout_s = pool_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_header_bytes = max_header_bytes
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[UpstreamConnection] = []

    @property
    def idle_connections(self) -> int:
        """Connections kept open for the next exchange."""
        return len(self._idle)

    async def acquire(self, *, new: bool = False) -> UpstreamConnection:
        """A connection: an idle fresh one, or (with `new`, or when none is idle) a new one.

        Waits at most `pool_timeout_s` for one of the `max_connections` slots, and at most
        `connect_timeout_s` to connect; raises `UpstreamError` when either runs out or the
        socket cannot be reached. The caller gives it back with `release`."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(self._pool_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise UpstreamError(f"all {self.max_connections} connections to the engine stayed busy "
                                    f"for {self._pool_timeout_s:g} s") from None
        else:
            await self._slots.acquire()  # a free slot: returns without suspending
        try:
            if not new:
                stale_before = time.monotonic() - self._idle_timeout_s
                while self._idle:
                    connection = self._idle.pop()
                    if connection.fresh and connection.idle_since >= stale_before:
                        return connection
                    connection.close()
            return await self._connect()
        except BaseException:
            self._slots.release()
            raise

    def release(self, connection: UpstreamConnection) -> None:
        """Give `connection` back: kept for the next exchange when its exchange ended cleanly with
        keep-alive, closed otherwise (an abandoned or half-read exchange never serves another)."""
        try:
            if connection.reusable:
                connection.protocol.start_next_cycle()
                connection.reused = True
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
            else:
                connection.close()
        finally:
            self._slots.release()

    def close_idle(self) -> None:
        """Close every idle connection (at shutdown; connections in use close when released)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    async def _connect(self) -> UpstreamConnection:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.path, limit=READ_CHUNK_BYTES)
        except TimeoutError:
            raise UpstreamError(f"connecting to the engine took over {self._connect_timeout_s:g} s") from None
        except OSError as exc:  # no socket file, nobody listening, permission
            raise UpstreamError(f"cannot connect to the engine: {exc.strerror or exc}") from None
        return UpstreamConnection(reader, writer, io_timeout_s=self._io_timeout_s,
                                  max_header_bytes=self._max_header_bytes)
