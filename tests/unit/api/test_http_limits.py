"""The limited HTTP protocol fed bytes directly (a fake transport, a tiny ASGI app): the head
budget never refuses what fits, and connections go back to waiting when they should."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import orjson
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.server import ServerState

from servewell.api.http_limits import HttpLimits, LimitedHttpToolsProtocol, limited_protocol

LIMITS = HttpLimits(
    max_header_bytes=1024,
    max_header_count=10,
    max_url_bytes=256,
    header_timeout_s=0.2,
    body_timeout_s=0.2,
    max_connections=2,
    reserved_connections=1,
    max_pipelined_requests=4,
    min_body_rate_bytes_s=1000.0,
    body_rate_grace_s=0.1,
    send_timeout_s=0.2,
)


class FakeTransport(asyncio.Transport):
    """Collects what the server writes; `close` is recorded, as a socket's would be."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.writes: list[bytes] = []  # each write call's bytes, in order
        self.closed = False
        self.aborted = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 413 at once when asked to (before reading the body), streams two chunks or fails after
    starting its answer when asked to, else echoes the body length."""
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")]})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        await send({"type": "http.response.body", "body": b"two"})
        return
    if scope["path"] == "/fail":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")]})
        raise RuntimeError("the app failed after starting its answer")
    if scope["path"] == "/hold":  # answers only when the test ends
        await asyncio.sleep(3600)
    if scope["path"] == "/early":
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = orjson.dumps({"size": size})
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
    )
    await send({"type": "http.response.body", "body": body})


def connect(limits: HttpLimits = LIMITS) -> tuple[LimitedHttpToolsProtocol, FakeTransport]:
    config = Config(app=app, ws="none", log_config=None, timeout_keep_alive=0.2)  # type: ignore[arg-type]
    config.load()
    protocol = limited_protocol(limits)(config=config, server_state=ServerState(), app_state={})
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


def statuses(transport: FakeTransport) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", bytes(transport.written))]


async def settle() -> None:
    await asyncio.sleep(0.05)  # the app's tasks run; a pipelined request starts once the one before is answered


def test_two_pipelined_requests_in_one_chunk_over_the_head_budget_are_both_served():
    async def run() -> None:
        protocol, transport = connect()
        one = b"GET /a HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 700 + b"\r\n\r\n"
        protocol.data_received(one + one)  # 1.5 KB in one read: each head fits its 1 KB budget
        await settle()
        assert statuses(transport) == [200, 200] and not transport.closed

    asyncio.run(run())


def test_a_body_in_the_same_read_as_its_head_does_not_count_against_the_head():
    async def run() -> None:
        protocol, transport = connect()
        body = b"b" * 5000
        protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + body)
        await settle()
        assert statuses(transport) == [200] and b'{"size":5000}' in transport.written

    asyncio.run(run())


def test_a_head_growing_past_the_budget_in_small_reads_gets_431():
    async def run() -> None:
        protocol, transport = connect()
        protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\nX-Long: ")
        for _ in range(20):
            if transport.closed:
                break
            protocol.data_received(b"v" * 100)
        assert statuses(transport) == [431] and transport.closed
        assert b'"code":"header_too_large"' in transport.written

    asyncio.run(run())


def test_an_answer_before_the_body_ended_leaves_the_connection_waiting_not_stuck():
    async def run() -> None:
        protocol, transport = connect(dataclasses.replace(LIMITS, max_body_bytes=4))  # too big to wait for
        protocol.data_received(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        await settle()
        assert statuses(transport) == [413]
        protocol.data_received(b"0123456789")  # the rest of the body, after the answer
        assert not transport.closed
        await asyncio.sleep(0.5)
        assert transport.closed  # closed by the 0.2 s keep-alive timer, not held forever

    asyncio.run(run())


def test_a_reserve_connection_serves_probes_only_and_closes_after_one_answer():
    async def run() -> None:
        limits = dataclasses.replace(LIMITS, max_connections=1)
        busy, _ = connect(limits)
        cls = type(busy)
        config = busy.config
        busy.data_received(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")  # holds its slot
        probe = cls(config=config, server_state=ServerState(), app_state={})
        probe_transport = FakeTransport()
        probe.connection_made(probe_transport)
        probe.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle()
        assert statuses(probe_transport) == [503] and probe_transport.closed
        assert b'"code":"unavailable"' in probe_transport.written

    asyncio.run(run())


def test_a_response_leaves_in_one_write_so_a_crash_cannot_cut_it_between_head_and_body():
    async def run() -> None:
        protocol, transport = connect()
        protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        await settle()
        assert len(transport.writes) == 1, transport.writes
        assert transport.writes[0].startswith(b"HTTP/1.1 200 ") and transport.writes[0].endswith(b'{"size":3}')

    asyncio.run(run())


def test_streamed_head_only_and_failed_answers_still_send_their_head():
    async def run() -> None:
        protocol, transport = connect()
        protocol.data_received(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle()
        assert len(transport.writes) == 2  # the head rides with the first chunk; the second follows
        assert transport.writes[0].startswith(b"HTTP/1.1 200 ") and transport.writes[0].endswith(b"\r\n\r\none")
        assert transport.writes[1] == b"two"

        protocol.data_received(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\n")  # no body is ever written
        await settle()
        assert len(transport.writes) == 3 and transport.writes[2].startswith(b"HTTP/1.1 200 ")
        assert transport.writes[2].endswith(b"\r\n\r\n") and not transport.closed

        protocol.data_received(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle()
        # As before the head was held: the head went out, then the connection closed (a cut answer).
        assert transport.writes[3].startswith(b"HTTP/1.1 200 ") and transport.closed

    asyncio.run(run())


def test_pipelined_requests_past_the_bound_are_not_parsed_and_the_one_over_gets_503():
    async def run() -> None:
        protocol, transport = connect()
        protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n" * 50)  # one read, nothing read back
        for _ in range(20):
            await settle()
        # the one answered first; the four queued behind it and the one over the bound are refused
        # without running the app (a client this far ahead reads nothing); nothing after
        assert statuses(transport) == [200] + [503] * 5 and transport.closed
        assert b"more than 4 requests were sent on one connection" in transport.written
        protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")  # late bytes are dropped, not parsed
        await settle()
        assert statuses(transport) == [200] + [503] * 5

    asyncio.run(run())


def test_a_body_slower_than_the_minimum_rate_gets_408_after_the_grace():
    async def run() -> None:
        protocol, transport = connect(dataclasses.replace(LIMITS, body_timeout_s=5.0))
        protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"b" * 50)
        await asyncio.sleep(0.05)
        protocol.data_received(b"b" * 50)  # within the grace: anything goes
        assert statuses(transport) == []
        await asyncio.sleep(0.3)  # 100 bytes in 0.35 s: below 1,000 bytes/s, long before the 5 s timeout
        assert statuses(transport) == [408] and transport.closed
        assert b"slower than 1000 bytes/s" in transport.written

    asyncio.run(run())


def test_a_body_at_the_minimum_rate_is_not_cut_short():
    async def run() -> None:
        protocol, transport = connect(dataclasses.replace(LIMITS, body_timeout_s=5.0))
        protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 800\r\n\r\n")
        for _ in range(8):  # 100 bytes every 0.05 s: 2,000 bytes/s
            protocol.data_received(b"b" * 100)
            await asyncio.sleep(0.05)
        await settle()
        assert statuses(transport) == [200] and b'{"size":800}' in transport.written

    asyncio.run(run())


def test_a_connection_still_sending_its_body_is_evicted_for_a_newcomer():
    async def run() -> None:
        limits = dataclasses.replace(LIMITS, max_connections=1, reserved_connections=0)
        slow, slow_transport = connect(limits)
        slow.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12")
        newcomer = type(slow)(config=slow.config, server_state=ServerState(), app_state={})
        newcomer_transport = FakeTransport()
        newcomer.connection_made(newcomer_transport)
        newcomer.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        await settle()
        assert statuses(slow_transport) == [503] and slow_transport.closed
        assert statuses(newcomer_transport) == [200]

    asyncio.run(run())


def test_only_http_1_with_one_host_is_served():
    async def run() -> None:
        for head, status in [(b"GET /a HTTP/2.0\r\nHost: x\r\n\r\n", 505), (b"GET /a HTTP/1.1\r\n\r\n", 400),
                             (b"GET /a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
                             (b"GET /a HTTP/1.0\r\n\r\n", 200)]:
            protocol, transport = connect()
            protocol.data_received(head)
            await settle()
            assert statuses(transport) == [status], head
            if status != 200:
                assert transport.closed and b'"error":{"code":' in transport.written

    asyncio.run(run())


def test_after_close_after_answers_every_answer_closes_its_connection():
    async def run() -> None:
        protocol, transport = connect()
        held, held_transport = connect()
        held.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n")  # answer not started
        protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle()
        assert b"connection: close" not in transport.written and not transport.closed
        type(protocol).close_after_answers([protocol, held])
        protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        held.data_received(b"abc")
        await settle()
        assert statuses(transport) == [200, 200] and transport.written.count(b"connection: close") == 1
        assert transport.closed
        assert b"connection: close" in held_transport.written and held_transport.closed

    asyncio.run(run())


def test_answers_nobody_reads_are_dropped_after_the_send_timeout():
    async def run() -> None:
        protocol, transport = connect()
        protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle()
        protocol.pause_writing()  # what the transport says when its buffer passes the high-water mark
        await asyncio.sleep(0.1)
        assert not transport.aborted
        await asyncio.sleep(0.2)
        assert transport.aborted

    asyncio.run(run())


def test_the_app_starts_only_once_a_body_that_fits_is_all_in():
    async def run() -> None:
        protocol, transport = connect()  # a 10-byte body fits max_body_bytes: nothing runs until it is in
        protocol.data_received(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n01234")
        await settle()
        assert statuses(transport) == []
        protocol.data_received(b"56789")
        await settle()
        assert statuses(transport) == [413]

    asyncio.run(run())
