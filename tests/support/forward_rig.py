"""A stand-in for the engine's private HTTP app, and the rig that puts `EngineForwarder`
(api/forward.py) in front of it: a real uvicorn on a unix socket serving a small Starlette app,
a second uvicorn on 127.0.0.1 serving the forwarder, a real HTTP client; or the forwarder called
as an ASGI app (`call`) where a test needs exact control of the request. Also engines that
misbehave at the byte level (`raw_engine`, `closing_on_second_request`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from inloop_uvicorn import Served, serving, stop
from servewell.api.forward import EngineForwarder
from servewell.api.peer import TrustedPeerMiddleware

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
        self.upload_cut = asyncio.Event()
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
        try:
            async for chunk in request.stream():
                if chunk:
                    self.first_body_chunk.set()
                    digest.update(chunk)
                    size, chunks = size + len(chunk), chunks + 1
        except ClientDisconnect:
            self.upload_cut.set()
            raise
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
