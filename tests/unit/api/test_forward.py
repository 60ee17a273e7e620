"""EngineForwarder (api/forward.py): round trips, streaming both ways, keep-alive connections,
clients that leave, and the headers that change on the way (tests/support/forward_rig.py has the
engine's stand-in and the rig)."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from starlette.types import Message

from forward_rig import (
    Engine,
    call,
    http_scope,
    names,
    rig,
)
from inloop_uvicorn import serving
from servewell.api.forward import EngineForwarder
from servewell.api.middleware import RequestContextMiddleware
from servewell.api.state import LiveKnobs
from servewell.observability.context import request_trace_var
from waiting import eventually_async


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Short: a unix socket's path is at most 107 bytes, and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sw-fwd-") as directory:
        yield Path(directory)


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


def test_a_client_leaving_mid_body_ends_the_request_at_the_engine(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            forwarder = EngineForwarder(path)
            messages = [{"type": "http.request", "body": b"x" * 1000, "more_body": True}]
            leave, sent = asyncio.Event(), []

            async def receive() -> Message:
                if messages:
                    return messages.pop(0)
                await leave.wait()
                return {"type": "http.disconnect"}

            async def send(message: Message) -> None:
                sent.append(message)

            scope = http_scope("POST", "/upload", headers=[(b"host", b"h"), (b"transfer-encoding", b"chunked")])
            forwarding = asyncio.ensure_future(forwarder(scope, receive, send))
            async with asyncio.timeout(2):
                await engine.first_body_chunk.wait()
            assert not engine.upload_cut.is_set()
            leave.set()
            async with asyncio.timeout(2):
                await engine.upload_cut.wait()
                await forwarding
            assert sent == [] and forwarder.idle_connections == 0
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


def test_a_traced_request_names_its_span_as_the_engines_parent(socket_dir):
    async def main():
        engine = Engine()
        path = str(socket_dir / "engine.sock")
        async with serving(engine.app, uds=path):
            forwarder = EngineForwarder(path)
            client_parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            headers = [(b"host", b"h"), (b"traceparent", client_parent)]

            def seen(echoed: dict[str, Any]) -> list[str]:
                return [value for name, value in echoed["headers"] if name == "traceparent"]

            # Not traced here: the client's own goes through.
            assert seen((await call(forwarder, http_scope(headers=list(headers)))).json()) == [client_parent.decode()]
            span = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7, is_remote=False,
                               trace_flags=TraceFlags(TraceFlags.SAMPLED))
            token = request_trace_var.set(trace.set_span_in_context(NonRecordingSpan(span)))
            try:
                echoed = (await call(forwarder, http_scope(headers=list(headers)))).json()
            finally:
                request_trace_var.reset(token)
            assert seen(echoed) == ["00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"]
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
