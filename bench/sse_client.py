"""A lean load generator for streamed answers (server-sent events or JSON lines over HTTP/1.1).

httpx parses each line of a stream through four layers (h11, httpcore, httpx's decoders, anyio):
32 clients reading 6,000 parts a second took a whole core of this 2-core machine, so the
load generator, not the server, set the figure. This client keeps one connection per caller,
reads what the socket has, undoes the chunked framing and looks at each line only far enough to
count a part (`text_output`, `outputs` or `choices` in it) or to read the final event (JSON).
It is used by `bench.streams` for every server it measures, servewell and the peer alike.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: Bytes of a response head or of an error answer's body this client reads at most.
MAX_HEAD_BYTES = 64 * 1024
_PART_MARKS = (b'"text_output"', b'"outputs"', b'"choices"')


@dataclass(slots=True)
class StreamResult:
    """One stream as its client saw it."""

    first: float = float("nan")  # seconds from sending the request to its first part
    gaps: list[float] = field(default_factory=list)  # seconds between parts
    count: int = 0  # parts
    final: dict[str, Any] | None = None  # the final event (servewell's `final: true`), if one came


class StreamError(RuntimeError):
    """The server refused the stream, or ended it with an error event."""


class SseClient:
    """One keep-alive HTTP/1.1 connection to `url`'s host that streams one request at a time."""

    def __init__(self, url: str, timeout_s: float = 120.0) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._path = parts.path or "/"
        self._timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader, self._writer = None, None

    async def stream(self, body: dict[str, Any]) -> StreamResult:
        """POST `body` as JSON and read its streamed answer to the end."""
        return await asyncio.wait_for(self._stream(json.dumps(body).encode()), self._timeout_s)

    async def _stream(self, payload: bytes) -> StreamResult:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Accept: text/event-stream\r\n\r\n%s" % (self._path.encode(), self._host.encode(), self._port,
                                                              len(payload), payload))
        started = time.perf_counter()
        try:
            return await self._read(reader, started)
        except BaseException:
            await self.close()  # a half-read answer leaves the connection unusable
            raise

    async def _read(self, reader: asyncio.StreamReader, started: float) -> StreamResult:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD_BYTES:
            raise StreamError("a response head over 64 KiB")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            body = await self._whole(reader, headers, chunked)
            raise StreamError(f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}")
        result = StreamResult()
        last = started
        pending = b""
        async for data in self._body(reader, headers, chunked):
            now = time.perf_counter()
            pending += data
            if b"\n" not in data:
                continue
            *complete, pending = pending.split(b"\n")
            for line in complete:
                if line.startswith(b"data: "):
                    line = line[6:]
                elif not line.startswith(b"{"):
                    continue
                if b'"final"' in line and b'"final":true' in line.replace(b" ", b""):
                    result.final = json.loads(line)
                    error = result.final.get("error")
                    if error:
                        raise StreamError(str(error)[:200])
                    continue
                if any(mark in line for mark in _PART_MARKS):
                    if result.count == 0:
                        result.first = now - started
                    else:
                        result.gaps.append(now - last)
                    last = now
                    result.count += 1
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return result

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str],
                    chunked: bool) -> AsyncIterator[bytes]:
        """The body's bytes as they come (chunked framing undone)."""
        if not chunked:
            length = int(headers.get("content-length", "0"))
            while length > 0:
                data = await reader.read(min(length, 65536))
                if not data:
                    raise StreamError("the connection closed mid-answer")
                length -= len(data)
                yield data
            return
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the last chunk's end (no trailers)
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]

    async def _whole(self, reader: asyncio.StreamReader, headers: dict[str, str], chunked: bool) -> bytes:
        body = b""
        async for data in self._body(reader, headers, chunked):
            body += data
            if len(body) > MAX_HEAD_BYTES:
                break
        return body
