"""Keep-alive HTTP/1.1 connections to the engine's private unix socket, for `api/forward.py`.

`UpstreamConnection` is one socket: the caller writes the request's bytes, and the answer is
parsed by httptools (llhttp, the C parser uvicorn serves with; h11 cost about 3x the CPU per
forwarded GET, `bench/forward_cost.py`). Every read and every wait for the engine to take bytes
ends within `io_timeout_s`, and the answer's head is bounded by `max_header_bytes`.
`UpstreamPool` hands out at most `max_connections` of them at a time, reusing idle ones (most
recently used first) and opening new ones on demand.

An idle connection is handed out again only when it is still fresh: the engine did not close
it (uvicorn closes a keep-alive connection after `timeout_keep_alive`, 5 s by default, and the
end of file is seen here as soon as it arrives) and it has been idle less than
`idle_timeout_s`, which stays below the engine's keep-alive timeout so that a request is
rarely written into a socket the engine is closing at that moment (the caller sends the rare
one that is once more, when it may: see `api/forward.py`).
"""

from __future__ import annotations

import asyncio
import time

import httptools

#: Largest read from the engine's socket at once.
READ_CHUNK_BYTES = 64 * 1024


class UpstreamError(Exception):
    """The engine could not be reached or did not answer properly; `str()` says how."""


class UpstreamClosed(UpstreamError):
    """The engine closed the connection before its answer was complete."""


class _Answer:
    """httptools callbacks collecting one answer: its head, the body parsed so far, its end."""

    __slots__ = ("parser", "head_only", "max_header_bytes", "status", "headers", "header_bytes", "head_done",
                 "close_delimited", "keep_alive", "body", "complete", "informational", "trailing")

    def __init__(self, head_only: bool, max_header_bytes: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.head_only = head_only  # the answer to HEAD: a head, whatever Content-Length says
        self.max_header_bytes = max_header_bytes
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.head_done = False
        self.close_delimited = False
        self.keep_alive = False
        self.body: list[bytes] = []
        self.complete = False
        self.informational = False
        self.trailing = False  # bytes after the answer: the connection is out of step

    def on_status(self, reason: bytes) -> None:
        if self.complete:
            self.trailing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes > self.max_header_bytes:
            raise UpstreamError(f"the engine's answer head is over {self.max_header_bytes} bytes")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise UpstreamError("the engine switched protocols, which nobody asked it to")
            self.informational, self.headers, self.header_bytes = True, [], 0  # 100/103: not the answer
            return
        if self.complete:
            return
        self.status, self.head_done = status, True
        framed = no_body = self.head_only or status in (204, 304)
        close = False
        for name, value in self.headers:
            if name == b"content-length" or name == b"transfer-encoding":
                framed = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        self.close_delimited = not framed  # HTTP/1.0 style: the body ends when the connection does
        self.keep_alive = framed and not close and self.parser.get_http_version() == "1.1"
        if no_body:
            self.complete = True

    def on_body(self, body: bytes) -> None:
        if self.complete:
            self.trailing = True
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
        else:
            self.complete = True


class UpstreamConnection:
    """One HTTP/1.1 connection to the engine. Not for sharing: one exchange at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 io_timeout_s: float, max_header_bytes: int) -> None:
        self._reader = reader
        self._writer = writer
        #: Longest wait for one read from, or one drain to, the engine.
        self.io_timeout_s = io_timeout_s
        #: Largest answer head accepted.
        self.max_header_bytes = max_header_bytes
        self._answer: _Answer | None = None
        self._fed_before_head = 0
        #: Whether the whole request was written (set by the caller): only then may it serve again.
        self.request_complete = False
        #: Whether this connection already carried an exchange (so the engine may have closed it).
        self.reused = False
        #: `time.monotonic()` seconds when it was last returned to the pool.
        self.idle_since = 0.0

    @property
    def fresh(self) -> bool:
        """Whether it may carry another exchange: neither side closed it."""
        return not self._reader.at_eof() and not self._writer.transport.is_closing()

    def begin(self, *, head_only: bool) -> None:
        """Start an exchange; `head_only` for a HEAD request, whose answer has no body."""
        self._answer = _Answer(head_only, self.max_header_bytes)
        self._fed_before_head = 0
        self.request_complete = False

    async def write(self, data: bytes) -> None:
        """Write request bytes and wait, at most `io_timeout_s`, until the engine has taken
        enough of what is buffered: back-pressure, not buffering."""
        self._writer.write(data)
        async with asyncio.timeout(self.io_timeout_s):
            await self._writer.drain()

    async def read(self) -> None:
        """Read what the engine sent next (waiting at most `io_timeout_s`) and parse it; raises
        `UpstreamClosed` at an end of file that cuts the answer short, `UpstreamError` for an
        answer that is not HTTP/1.1 or whose head is too large."""
        answer = self._answer
        assert answer is not None, "begin() first"
        async with asyncio.timeout(self.io_timeout_s):
            data = await self._reader.read(READ_CHUNK_BYTES)
        if not data:
            if answer.head_done and answer.close_delimited:
                answer.complete = True
                return
            raise UpstreamClosed("the engine closed the connection" + (" mid-answer" if answer.head_done else ""))
        if not answer.head_done:
            self._fed_before_head += len(data)
            if self._fed_before_head > self.max_header_bytes + READ_CHUNK_BYTES:
                raise UpstreamError(f"the engine's answer head is over {self.max_header_bytes} bytes")
        try:
            answer.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, UpstreamError):  # raised by a callback of ours
                raise exc.__context__ from None
            raise UpstreamError(f"the engine's answer is not HTTP/1.1: {exc}") from None

    @property
    def head(self) -> tuple[int, list[tuple[bytes, bytes]]] | None:
        """The answer's status and headers (names in lower case), once its head was read."""
        answer = self._answer
        return (answer.status, answer.headers) if answer is not None and answer.head_done else None

    @property
    def complete(self) -> bool:
        """Whether the whole answer was read."""
        return self._answer is not None and self._answer.complete

    def take_body(self) -> bytes:
        """The body bytes read since the last call."""
        answer = self._answer
        if answer is None or not answer.body:
            return b""
        pieces, answer.body = answer.body, []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    @property
    def reusable(self) -> bool:
        """Whether the exchange ended cleanly on both sides, the engine allowed keep-alive and
        nobody closed the socket since."""
        answer = self._answer
        return (answer is not None and answer.complete and answer.keep_alive and not answer.trailing
                and self.request_complete and self.fresh)

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
