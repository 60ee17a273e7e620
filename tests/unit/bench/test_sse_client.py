"""bench/sse_client.py against a tiny HTTP server: parts counted across chunk boundaries (servewell's
SSE and LitServe's JSON lines), the final event read, a refusal and an error event raised, and
the connection kept alive between streams."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/ is a folder of the repository, not a package
from bench.sse_client import SseClient, StreamError

SSE = [b'data: {"text_output": "a"}\n\n', b'data: {"text_out', b'put": "b"}\n\ndata: {"text_output": "c"}\n\n',
       b'data: {"final": true, "finish_reason": "length", "parts": 3, "server_timing": "compute;dur=1.5"}\n\n']
LINES = [b'{"text_output": "x"}\n{"text_output": "y"}\n']


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def serve(answers: list[bytes]) -> tuple[asyncio.AbstractServer, int, list[int]]:
    """A server answering each request on a connection with the next of `answers`; the connections made."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(answers.pop(0))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def test_parts_are_counted_across_chunks_and_the_connection_is_kept() -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def main() -> None:
        server, port, connections = await serve([ok + chunked(SSE), ok + chunked(LINES)])
        client = SseClient(f"http://127.0.0.1:{port}/v2/models/m/generate_stream")
        first = await client.stream({"text_input": "x"})
        assert first.count == 3 and len(first.gaps) == 2 and first.first >= 0
        assert first.final is not None and first.final["server_timing"] == "compute;dur=1.5"
        second = await client.stream({"text_input": "x"})  # JSON lines, as LitServe writes them
        assert second.count == 2 and second.final is None
        assert len(connections) == 1
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_refusal_and_an_error_event_raise() -> None:
    refused = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 22\r\n\r\n{\"code\": \"overloaded\"}"
    ok = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    failed = chunked([b'data: {"final": true, "error": {"code": "deadline_exceeded"}}\n\n'])

    async def main() -> None:
        server, port, _ = await serve([refused, ok + failed])
        client = SseClient(f"http://127.0.0.1:{port}/s")
        with pytest.raises(StreamError, match="HTTP 503.*overloaded"):
            await client.stream({})
        with pytest.raises(StreamError, match="deadline_exceeded"):
            await client.stream({})
        await client.close()
        server.close()

    asyncio.run(main())
