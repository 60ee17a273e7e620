"""EngineForwarder (api/forward.py) against a real uvicorn on a unix socket serving a small
Starlette app (the engine's stand-in), reached through a second uvicorn on 127.0.0.1 with a real
HTTP client, or by calling the forwarder as an ASGI app where a test needs exact control of the
request (headers a client library would not send, no client address)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from inloop_uvicorn import Served, serving, stop
from servewell.api.forward import EngineForwarder, EngineStreamBroken
from servewell.api.middleware import RequestContextMiddleware
from servewell.api.peer import TrustedPeerMiddleware
from servewell.api.state import LiveKnobs
from waiting import eventually_async

ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class Engine:
    """The engine's stand-in: the answers the forwarder must carry, and events the tests wait on."""

    def __init__(self) -> None:
        self.first_body_chunk = asyncio.Event()
        self.first_event_read = asyncio.Event()
        self.stream_ended = asyncio.Event()
        self.hanging = asyncio.Event()
        self.saw_disconnect = asyncio.Event()
        self.release = asyncio.Event()
        self.app = Starlette(routes=[
            Route("/echo", self.echo, methods=ALL_METHODS), Route("/v2/echo", self.echo, methods=ALL_METHODS),
            Route("/upload", self.upload, methods=["POST"]), Route("/sse", self.sse), Route("/forever", self.forever),
            Route("/fixed", lambda _: JSONResponse({"fixed": True})),
            Route("/empty", lambda _: Response(status_code=204)),
            Route("/not-modified", lambda _: Response(status_code=304, headers={"etag": '"v1"'})),
            Route("/close", lambda _: JSONResponse({"ok": True}, headers={"connection": "close"})),
            Route("/hop", self.hop), Route("/hang", self.hang), Route("/slow", self.slow),
        ])

    async def echo(self, request: Request) -> Response:
        body = await request.body()
        return JSONResponse(
            {"method": request.method, "raw_path": request.scope["raw_path"].decode(),
             "query": request.scope["query_string"].decode(), "client": request.scope["client"],
             "headers": [[name.decode(), value.decode()] for name, value in request.scope["headers"]],
             "body_sha256": hashlib.sha256(body).hexdigest(), "body_len": len(body)},
            status_code=int(request.query_params.get("status", "200")), headers={"x-answer": "yes"})

    async def upload(self, request: Request) -> Response:
        digest, size, chunks = hashlib.sha256(), 0, 0
        async for chunk in request.stream():
            if chunk:
                self.first_body_chunk.set()
                digest.update(chunk)
                size, chunks = size + len(chunk), chunks + 1
        return JSONResponse({"size": size, "sha256": digest.hexdigest(), "chunks": chunks})

    async def sse(self, request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            await self.first_event_read.wait()  # the client has the first event before the second exists
            yield b"data: 2\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def forever(self, request: Request) -> Response:
        async def ticks() -> AsyncIterator[bytes]:
            try:
                for n in range(100_000):
                    yield f"data: {n}\n\n".encode()
                    await asyncio.sleep(0.005)
            finally:
                self.stream_ended.set()
        return StreamingResponse(ticks(), media_type="text/event-stream")

    async def hop(self, request: Request) -> Response:
        return Response(b"hop", headers={"keep-alive": "timeout=5", "connection": "x-hop", "x-hop": "1",
                                         "proxy-thing": "2", "x-keep": "3", "x-request-id": "engine-id",
                                         "x-process-time": "0.5"})

    async def hang(self, request: Request) -> Response:
        self.hanging.set()
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.saw_disconnect.set()
        return Response(status_code=499)

    async def slow(self, request: Request) -> Response:
        await self.release.wait()
        return Response(b"done")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Short: a unix socket's path is at most 107 bytes, and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sw-fwd-") as directory:
        yield Path(directory)


@dataclass
class Rig:
    engine: Engine
    upstream: Served
    forwarder: EngineForwarder
    front: Served
    client: httpx.AsyncClient


@contextlib.asynccontextmanager
async def rig(socket_dir: Path, forwarder_options: dict[str, Any] | None = None,
              wrap_engine: bool = False, **engine_options: Any) -> AsyncIterator[Rig]:
    """Engine on a unix socket, forwarder on 127.0.0.1, an httpx client to the forwarder."""
    engine = Engine()
    path = str(socket_dir / "engine.sock")
    app = TrustedPeerMiddleware(engine.app) if wrap_engine else engine.app
    async with serving(app, uds=path, **engine_options) as upstream:
        forwarder = EngineForwarder(path, **(forwarder_options or {}))
        async with serving(forwarder) as front:
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}", timeout=5) as client:
                    yield Rig(engine, upstream, forwarder, front, client)
            finally:
                stop(upstream.server)  # both servers stop at once
        forwarder.close()


@dataclass
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    def header(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]


def http_scope(method: str = "GET", path: str = "/echo", *, headers: list[tuple[bytes, bytes]] | None = None,
               query: bytes = b"", client: tuple[str, int] | None = ("10.1.2.3", 4567)) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "headers": headers if headers is not None else [(b"host", b"example.test")],
            "client": client, "server": ("127.0.0.1", 8000)}


async def call(app: Any, scope: dict[str, Any], body: bytes = b"", leave: asyncio.Event | None = None) -> Answer:
    """Call `app` as a server would, with the whole body in one message; the client leaves when `leave` is set."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if not sent:
        return Answer(0, [], b"")
    start = sent[0]
    return Answer(start["status"], list(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:]))


def names(echoed: dict[str, Any]) -> list[str]:
    return [name for name, _ in echoed["headers"]]


# --- round trips --------------------------------------------------------------------------------

def test_status_headers_body_and_query_make_the_round_trip(socket_dir):
    async def main():
        async with rig(socket_dir) as r:
            body = b'{"x": [1, 2, 3]}'
            answer = await r.client.post("/echo?status=201&a=1&b=%20x%2F", content=body,
                                         headers={"x-custom": "v", "content-type": "application/json"})
            assert answer.status_code == 201
            assert answer.headers["x-answer"] == "yes"
            # One Date and one Server: the front's own, not the engine's as well.
            assert len(answer.headers.get_list("date")) == 1 and len(answer.headers.get_list("server")) == 1
            echoed = answer.json()
            assert echoed["method"] == "POST"
            assert echoed["raw_path"] == "/echo" and echoed["query"] == "status=201&a=1&b=%20x%2F"
            assert echoed["body_len"] == len(body) and echoed["body_sha256"] == hashlib.sha256(body).hexdigest()
            headers = dict(echoed["headers"])
            assert headers["x-custom"] == "v" and headers["content-type"] == "application/json"
            assert headers["host"] == f"127.0.0.1:{r.front.port}"  # kept as the client sent it
            assert headers["content-length"] == str(len(body))
            for method in ("PUT", "PATCH", "DELETE", "OPTIONS"):
                assert (await r.client.request(method, "/echo")).json()["method"] == method
    asyncio.run(main())


def test_a_large_request_body_streams_to_the_engine_before_it_ends(socket_dir):
    async def main():
        async with rig(socket_dir) as r:
            piece = bytes(range(256)) * 256  # 64 KiB
            digest = hashlib.sha256()

            async def body() -> AsyncIterator[bytes]:
                for n in range(64):  # 4 MiB, sent chunked
                    if n == 1:
                        # Only a forwarder that passes the body on as it comes lets the engine see it now.
                        async with asyncio.timeout(2):
                            await r.engine.first_body_chunk.wait()
                    digest.update(piece)
                    yield piece

            answer = await r.client.post("/upload", content=body())
            assert answer.status_code == 200
            assert answer.json()["size"] == 64 * len(piece) and answer.json()["sha256"] == digest.hexdigest()
            assert answer.json()["chunks"] > 1
    asyncio.run(main())


def test_a_streamed_answer_arrives_event_by_event(socket_dir):
    async def main():
        async with rig(socket_dir) as r:
            async with r.client.stream("GET", "/sse") as answer:
                assert answer.headers["content-type"].startswith("text/event-stream")
                assert "content-length" not in answer.headers
                chunks = answer.aiter_raw()
                async with asyncio.timeout(2):  # a buffering forwarder would wait here for the end, which needs us
                    assert await anext(chunks) == b"data: 1\n\n"
                r.engine.first_event_read.set()
                assert b"".join([chunk async for chunk in chunks]) == b"data: 2\n\n"
    asyncio.run(main())


def test_head_204_and_304_carry_no_body_and_the_connection_serves_on(socket_dir):
    async def main():
        async with rig(socket_dir, {"max_connections": 1}) as r:
            full = await r.client.get("/fixed")
            head = await r.client.head("/fixed")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == full.headers["content-length"]
            empty = await r.client.get("/empty")
            assert empty.status_code == 204 and empty.content == b"" and "content-length" not in empty.headers
            not_modified = await r.client.get("/not-modified")
            assert not_modified.status_code == 304 and not_modified.headers["etag"] == '"v1"'
            assert (await r.client.get("/echo")).json()["method"] == "GET"  # framing stayed in step
            assert r.upstream.connections_accepted == 1
    asyncio.run(main())


# --- connections ---------------------------------------------------------------------------------

def test_keep_alive_connections_are_reused(socket_dir):
    async def main():
        async with rig(socket_dir) as r:
            for _ in range(10):
                assert (await r.client.get("/echo")).status_code == 200
            assert r.upstream.connections_accepted == 1
            answers = await asyncio.gather(*(r.client.get("/echo") for _ in range(20)))
            assert all(answer.status_code == 200 for answer in answers)
            assert r.upstream.connections_accepted < 21
            assert r.forwarder.idle_connections >= 1
    asyncio.run(main())


def test_a_connection_the_engine_closes_is_not_reused(socket_dir):
    async def main():
        async with rig(socket_dir) as r:
            for _ in range(3):
                assert (await r.client.get("/close")).json() == {"ok": True}
            assert r.upstream.connections_accepted == 3
            assert r.forwarder.idle_connections == 0
    asyncio.run(main())


def test_an_idle_connection_the_engine_closed_is_replaced(socket_dir):
    async def main():
        async with rig(socket_dir, timeout_keep_alive=0.05) as r:
            assert (await r.client.get("/echo")).status_code == 200

            async def engine_closed_it() -> bool:
                return r.upstream.connections_open == 0
            await eventually_async(engine_closed_it, 2, "the engine never closed its idle keep-alive connection")
            assert (await r.client.get("/echo")).status_code == 200
            assert r.upstream.connections_accepted == 2
    asyncio.run(main())


def test_when_every_connection_is_busy_a_request_waits_then_gets_503(socket_dir):
    async def main():
        async with rig(socket_dir, {"max_connections": 1, "pool_timeout_s": 0.1}) as r:
            first = asyncio.ensure_future(r.client.get("/slow"))
            await eventually_async(lambda: _true(r.upstream.connections_accepted == 1), 2, "the first never arrived")
            second = await r.client.get("/echo")
            assert second.status_code == 503 and second.json()["error"]["code"] == "engine_unavailable"
            assert "busy" in second.json()["error"]["message"]
            r.engine.release.set()
            assert (await first).content == b"done"
            assert (await r.client.get("/echo")).status_code == 200
    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value


def test_a_client_leaving_mid_stream_closes_that_engine_connection(socket_dir):
    async def main():
        async with rig(socket_dir, {"max_connections": 1, "pool_timeout_s": 2}) as r:
            async with r.client.stream("GET", "/forever") as answer:
                chunks = answer.aiter_raw()
                assert (await anext(chunks)).startswith(b"data: 0")
                await anext(chunks)
                assert not r.engine.stream_ended.is_set()  # it was running while the client read
            # httpx closed the connection without reading on: the engine's stream must end ...
            async with asyncio.timeout(2):
                await r.engine.stream_ended.wait()
            # ... and its one connection slot be free again.
            assert (await r.client.get("/echo")).status_code == 200
            assert r.forwarder.idle_connections == 1
    asyncio.run(main())


def test_a_client_leaving_before_the_answer_reaches_the_engine(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            forwarder = EngineForwarder(path)
            leave = asyncio.Event()
            call_done = asyncio.ensure_future(call(forwarder, http_scope(path="/hang"), leave=leave))
            async with asyncio.timeout(2):
                await engine.hanging.wait()
            assert not engine.saw_disconnect.is_set()
            leave.set()
            async with asyncio.timeout(2):
                await engine.saw_disconnect.wait()
                answer = await call_done
            assert answer.status == 0  # nothing was sent to a client that left
            assert forwarder.idle_connections == 0
    asyncio.run(main())


# --- headers -------------------------------------------------------------------------------------

def test_the_client_address_replaces_any_client_supplied_peer_header(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            forwarder = EngineForwarder(path)
            forged = [(b"host", b"h"), (b"x-servewell-peer", b"6.6.6.6:1"), (b"X-Servewell-Peer".lower(), b"7.7.7.7:2")]
            cases = [(("10.1.2.3", 4567), ["10.1.2.3:4567"]), (("::1", 80), ["[::1]:80"]), (None, [])]
            for client, expected in cases:
                echoed = (await call(forwarder, http_scope(headers=list(forged), client=client))).json()
                assert [value for name, value in echoed["headers"] if name == "x-servewell-peer"] == expected
    asyncio.run(main())


def test_the_engine_behind_the_peer_middleware_sees_the_real_client(socket_dir):
    async def main():
        async with rig(socket_dir, wrap_engine=True) as r:
            echoed = (await r.client.get("/echo", headers={"x-servewell-peer": "6.6.6.6:1"})).json()
            host, port = echoed["client"]
            assert host == "127.0.0.1" and port != 1
            assert "x-servewell-peer" not in names(echoed)
    asyncio.run(main())


def test_hop_by_hop_headers_are_dropped_both_ways(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            forwarder = EngineForwarder(path)
            headers = [(b"host", b"h"), (b"connection", b"keep-alive, x-listed"), (b"x-listed", b"1"),
                       (b"keep-alive", b"timeout=5"), (b"te", b"trailers"), (b"upgrade", b"h2c"),
                       (b"proxy-authorization", b"Basic eA=="), (b"trailer", b"x"), (b"expect", b"100-continue"),
                       (b"x-kept", b"yes")]
            echoed = (await call(forwarder, http_scope(headers=headers))).json()
            assert set(names(echoed)) == {"host", "x-kept", "x-servewell-peer"}
            answer = await call(forwarder, http_scope(path="/hop"))
            assert answer.body == b"hop"
            kept = {name for name, _ in answer.headers}
            assert kept == {b"content-length", b"x-keep", b"x-request-id", b"x-process-time"}
    asyncio.run(main())


def test_under_the_ingress_middleware_one_request_id_reaches_the_engine(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            forwarder = EngineForwarder(path)
            ingress = RequestContextMiddleware(forwarder, LiveKnobs(0.3, False))
            headers = [(b"host", b"h"), (b"x-request-id", b"client-id-1")]
            answer = await call(ingress, http_scope(headers=headers))
            assert answer.header(b"x-request-id") == [b"client-id-1"]
            assert [value for name, value in answer.json()["headers"] if name == "x-request-id"] == ["client-id-1"]
            hop = await call(ingress, http_scope(path="/hop"))
            (ingress_id,) = hop.header(b"x-request-id")  # the ingress's, not the engine's as well
            assert ingress_id != b"engine-id" and len(hop.header(b"x-process-time")) == 1
    asyncio.run(main())


def test_a_header_http_forbids_gets_400(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            answer = await call(EngineForwarder(path), http_scope(headers=[(b"host", b"h"), (b"x-bad", b"a\x00b")]))
            assert answer.status == 400 and answer.json()["error"]["code"] == "bad_request"
    asyncio.run(main())


# --- failures ------------------------------------------------------------------------------------

def assert_engine_unavailable(answer: Answer, oip: bool = False) -> str:
    assert answer.status == 503
    assert answer.header(b"x-error-code") == [b"engine_unavailable"]
    assert answer.header(b"retry-after") == [b"1"]
    document = answer.json()
    if oip:
        assert document["code"] == "engine_unavailable" and isinstance(document["error"], str)
        return str(document["error"])
    assert document["error"]["code"] == "engine_unavailable"
    return str(document["error"]["message"])


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


@contextlib.asynccontextmanager
async def raw_engine(path: Path, answer: bytes | None, *, close: bool = True) -> AsyncIterator[None]:
    """An engine that reads a request head, writes `answer` (nothing when None) and closes (or hangs)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        if not close:
            await asyncio.sleep(10)
        writer.close()

    server = await asyncio.start_unix_server(handle, str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


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


@contextlib.asynccontextmanager
async def closing_on_second_request(path: Path, accepted: list[int]) -> AsyncIterator[None]:
    """An engine that answers a connection's first request, then closes it when the next one
    comes (an idle keep-alive connection it closed at the moment the request was written)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_unix_server(handle, str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


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
