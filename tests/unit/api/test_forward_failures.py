"""EngineForwarder (api/forward.py) when the engine is missing, silent, slow or answers badly:
503 engine_unavailable before an answer began, an aborted connection after."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from forward_rig import (
    assert_engine_unavailable,
    call,
    closing_on_second_request,
    http_scope,
    raw_engine,
)
from inloop_uvicorn import serving
from servewell.api.forward import EngineForwarder, EngineStreamBroken


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Short: a unix socket's path is at most 107 bytes, and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sw-fwd-") as directory:
        yield Path(directory)


def test_no_engine_socket_gets_503_in_the_routes_error_shape(socket_dir):
    async def main():
        forwarder = EngineForwarder(str(socket_dir / "missing.sock"))
        assert "cannot connect" in assert_engine_unavailable(await call(forwarder, http_scope(path="/admin/x")))
        assert_engine_unavailable(await call(forwarder, http_scope(path="/v2/health/ready")), oip=True)
        # A socket file nobody listens on: refused.
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound.bind(str(socket_dir / "refusing.sock"))
        try:
            refused = await call(EngineForwarder(str(socket_dir / "refusing.sock")), http_scope())
            assert "cannot connect" in assert_engine_unavailable(refused)
        finally:
            bound.close()
    asyncio.run(main())


def test_an_engine_closing_without_an_answer_gets_503(socket_dir):
    async def main():
        path = socket_dir / "raw.sock"
        async with raw_engine(path, None):
            message = assert_engine_unavailable(await call(EngineForwarder(str(path)), http_scope()))
            assert "without answering" in message
    asyncio.run(main())


def test_a_silent_engine_times_out_with_503(socket_dir):
    async def main():
        path = socket_dir / "raw.sock"
        async with raw_engine(path, None, close=False):
            answer = await call(EngineForwarder(str(path), read_timeout_s=0.1), http_scope())
            assert "did not answer within 0.1 s" in assert_engine_unavailable(answer)
    asyncio.run(main())


def test_an_oversized_answer_head_gets_503(socket_dir):
    async def main():
        path = socket_dir / "raw.sock"
        head = b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 20_000 + b"\r\ncontent-length: 0\r\n\r\n"
        async with raw_engine(path, head):
            answer = await call(EngineForwarder(str(path), max_response_header_bytes=16_384), http_scope())
            assert_engine_unavailable(answer)
        async with raw_engine(path, head):  # the same head within a larger bound passes
            assert (await call(EngineForwarder(str(path)), http_scope())).status == 200
    asyncio.run(main())


@pytest.mark.parametrize("answer,status,body,keep_alive", [
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end", 200, b"until the end", False),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok", 201, b"ok", True),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", 200, b"abcde",
     True),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nold", 200, b"old", False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok", 200, b"ok", False),
])
def test_answers_framed_every_way_http_allows(socket_dir, answer, status, body, keep_alive):
    async def main():
        path = socket_dir / "raw.sock"
        async with raw_engine(path, answer, close=not keep_alive):
            forwarder = EngineForwarder(str(path))
            got = await call(forwarder, http_scope())
            assert (got.status, got.body) == (status, body)
            assert forwarder.idle_connections == keep_alive  # kept only where HTTP/1.1 says it may be
    asyncio.run(main())


def test_an_answer_broken_off_after_it_began_aborts_the_client(socket_dir):
    async def main():
        path = socket_dir / "raw.sock"
        async with raw_engine(path, b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc"):
            with pytest.raises(EngineStreamBroken):
                await call(EngineForwarder(str(path)), http_scope())
    asyncio.run(main())


def test_a_304_with_a_content_length_passes_through_a_real_server(socket_dir):
    async def main():
        path = socket_dir / "raw.sock"
        # RFC 9110 8.6 allows a 304 to name the length of what it stands for; uvicorn refuses to
        # send a Content-Length it then sees no body for, so the forwarder drops it.
        async with raw_engine(path, b"HTTP/1.1 304 Not Modified\r\ncontent-length: 42\r\netag: \"v\"\r\n\r\n"):
            forwarder, raised = EngineForwarder(str(path)), []

            async def app(scope: Scope, receive: Receive, send: Send) -> None:
                try:
                    await forwarder(scope, receive, send)
                except Exception as exc:  # what uvicorn would log and cut the connection for
                    raised.append(exc)
                    raise

            async with serving(app) as front:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
                    answer = await client.get("/")
                    assert answer.status_code == 304 and answer.headers["etag"] == '"v"'
            assert raised == []
    asyncio.run(main())


def test_a_safe_request_on_a_connection_closed_under_it_is_sent_again_once(socket_dir):
    async def main():
        path, accepted = socket_dir / "raw.sock", [0]
        async with closing_on_second_request(path, accepted):
            forwarder = EngineForwarder(str(path))
            assert (await call(forwarder, http_scope())).body == b"ok"
            again = await call(forwarder, http_scope())  # on the reused connection: closed, then a new one
            assert again.status == 200 and again.body == b"ok" and accepted[0] == 2
            # A POST may have been acted on: never sent twice.
            refused = await call(forwarder, http_scope("POST"), body=b"{}")
            assert "without answering" in assert_engine_unavailable(refused)
            assert accepted[0] == 2
    asyncio.run(main())


def test_websocket_scopes_are_closed():
    async def main():
        sent: list[Message] = []

        async def receive() -> Message:
            return {"type": "websocket.connect"}

        async def send(message: Message) -> None:
            sent.append(message)

        await EngineForwarder("/nonexistent.sock")({"type": "websocket", "path": "/ws", "headers": []}, receive, send)
        assert [message["type"] for message in sent] == ["websocket.close"]
    asyncio.run(main())
