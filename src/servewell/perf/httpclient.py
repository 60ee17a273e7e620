"""A minimal asyncio HTTP/1.1 keep-alive client for the load generator.

General clients (httpx, aiohttp) spend tens to hundreds of microseconds per request in
Python; on a 2-core machine that CPU is taken from the server under test. This client
sends pre-encoded request bytes and parses only what a benchmark needs: the status, the
Content-Length, the `Server-Timing` entries, and the body.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

#: Largest response header block accepted; anything bigger is a broken server.
MAX_HEADER_BYTES = 65_536
#: Largest response body read; a benchmark never needs more, and a broken server cannot make us allocate more.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Reopen a connection idle longer than this: uvicorn closes keep-alive connections idle for 5 s.
IDLE_RECONNECT_S = 4.0


class ProtocolError(Exception):
    """The server answered something that is not a well-formed HTTP/1.1 response."""


@dataclass(slots=True)
class HttpResponse:
    """What the load generator needs of one response."""

    status: int
    body: bytes
    timings: dict[str, float] | None  # Server-Timing entries in ms (preprocess, queue, compute, total), if sent


def encode_request(method: str, host: str, path: str, body: bytes = b"",
                   headers: dict[str, str] | None = None, content_type: str = "application/json") -> bytes:
    """The complete HTTP/1.1 request as bytes, ready to be written as is."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    if body:
        lines.append(f"Content-Type: {content_type}")
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_server_timing(value: bytes) -> dict[str, float]:
    """`name;dur=ms, ...` entries of a Server-Timing header as {name: ms}."""
    timings: dict[str, float] = {}
    for entry in value.split(b","):
        name, _, params = entry.strip().partition(b";")
        _, found, dur = params.partition(b"dur=")
        if found:
            try:
                timings[name.decode("latin-1")] = float(dur.split(b";", 1)[0])
            except ValueError:
                pass
    return timings


class HttpConnection:
    """One keep-alive connection; one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._last_used = 0.0
        self.retries = 0  # requests resent because the server had closed the idle connection

    @property
    def connected(self) -> bool:
        """Whether a socket is open."""
        return self._writer is not None

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the socket (called lazily by `request`)."""
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEADER_BYTES)
        self._last_used = asyncio.get_running_loop().time()
        return self._reader, self._writer

    async def request(self, raw: bytes) -> HttpResponse:
        """Send one pre-encoded request and read the whole response.

        A connection idle for longer than the server's keep-alive timeout is reopened first,
        and a reused connection that the server closed before answering a single byte is
        retried once on a fresh one (what HTTP clients do: the request was never read).
        On any other failure the connection is closed, so the next call reconnects.
        """
        now = asyncio.get_running_loop().time()
        if self._writer is not None and now - self._last_used > IDLE_RECONNECT_S:
            self.close()
        reused = self._writer is not None
        try:
            return await self._exchange(raw)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            self.retries += 1
            return await self._exchange(raw)

    async def _exchange(self, raw: bytes) -> HttpResponse:
        reader, writer = self._reader, self._writer
        if reader is None or writer is None:
            reader, writer = await self.connect()
        try:
            writer.write(raw)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status, length, timings, close = _parse_head(head)
            body = await reader.readexactly(length) if length else b""
        except BaseException:
            # Cancelled (a client-side timeout) or broken: the answer may still arrive, so
            # this socket can never carry another request.
            self.close()
            raise
        self._last_used = asyncio.get_running_loop().time()
        if close:
            self.close()
        return HttpResponse(status, body, timings)

    def close(self) -> None:
        """Close the socket (no waiting)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def _parse_head(head: bytes) -> tuple[int, int, dict[str, float] | None, bool]:
    """(status, content length, Server-Timing entries, connection: close) of a response head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    length = 0
    timings = None
    close = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"content-length":
            if not value.strip().isdigit() or int(value) > MAX_BODY_BYTES:
                raise ProtocolError(f"unusable Content-Length {value.strip()[:20]!r}")
            length = int(value)
        elif key == b"server-timing":
            timings = parse_server_timing(value)
        elif key == b"connection" and value.strip().lower() == b"close":
            close = True
        elif key == b"transfer-encoding":
            raise ProtocolError("chunked responses are not supported by the benchmark client")
    return status, length, timings, close


async def fetch(host: str, port: int, method: str, path: str, body: bytes = b"", timeout_s: float = 10.0,
                headers: dict[str, str] | None = None) -> HttpResponse:
    """One request on a fresh connection (for metadata, health checks and admin calls)."""
    connection = HttpConnection(host, port)
    try:
        raw = encode_request(method, host, path, body, headers)
        return await asyncio.wait_for(connection.request(raw), timeout_s)
    finally:
        connection.close()
