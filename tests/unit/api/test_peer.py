"""x-servewell-peer (api/peer.py): the format an ingress writes, the strict parse, and the engine
middleware that turns it into scope["client"] and hides it from everything downstream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from servewell.api.peer import PEER_HEADER, TrustedPeerMiddleware, format_peer, parse_peer


@pytest.mark.parametrize("client,value", [
    (("10.1.2.3", 4567), b"10.1.2.3:4567"),
    (("::1", 80), b"[::1]:80"),
    (("2001:db8::7", 65535), b"[2001:db8::7]:65535"),
    (None, None), (("", 0), None), (("1.2.3.4", None), None), ([], None), ("1.2.3.4:5", None),
])
def test_format(client, value):
    assert format_peer(client) == value
    if value is not None:
        assert parse_peer(value) == (client[0], client[1])


@pytest.mark.parametrize("value", [
    b"", b"1.2.3.4", b"1.2.3.4:", b":80", b"1.2.3.4:65536", b"1.2.3.4:-1", b"1.2.3.4:+80", b"1.2.3.4: 80",
    b" 1.2.3.4:80", b"1.2.3.4:80 ", b"1.2.3.4:0x50", b"1.2.3.4:\xd9\xa0", b"1.2.3:80", b"01.2.3.4:80",
    b"256.1.1.1:80", b"localhost:80", b"example.com:443", b"::1:80", b"[::1]", b"[::1]80", b"[1.2.3.4]:80",
    b"[::1]:80:80", b"[::zz]:80", b"1.2.3.4:123456", b"1.2.3.4:80\r\nx: y", b"[" + b"1" * 100 + b"]:80",
])
def test_malformed_values_parse_to_none(value):
    assert parse_peer(value) is None


def test_well_formed_values_parse():
    assert parse_peer(b"127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_peer(b"[0:0:0:0:0:0:0:1]:8080") == ("::1", 8080)  # the address as Python writes it
    assert parse_peer(b"[fe80::1%eth0]:22") == ("fe80::1%eth0", 22)


def seen_by_app(headers: list[tuple[bytes, bytes]], scope_type: str = "http",
                client: Any = ("10.9.9.9", 1)) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the scope the wrapped app saw, the scope the middleware was given)."""
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(scope)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    given = {"type": scope_type, "headers": headers, "client": client}
    asyncio.run(TrustedPeerMiddleware(app)(given, receive, send))
    return seen, given


def test_the_header_becomes_the_client_and_disappears():
    headers = [(b"host", b"engine"), (PEER_HEADER, b"203.0.113.9:51234"), (b"accept", b"*/*")]
    seen, given = seen_by_app(headers)
    assert seen["client"] == ("203.0.113.9", 51234)
    assert seen["headers"] == [(b"host", b"engine"), (b"accept", b"*/*")]
    assert given["headers"] == headers and given["client"] == ("10.9.9.9", 1)  # the caller's scope is not changed


def test_websocket_scopes_too():
    seen, _ = seen_by_app([(PEER_HEADER, b"[2001:db8::1]:443")], scope_type="websocket")
    assert seen["client"] == ("2001:db8::1", 443) and seen["headers"] == []


@pytest.mark.parametrize("headers", [
    [(PEER_HEADER, b"evil.example:80")],
    [(PEER_HEADER, b"1.2.3.4:80"), (PEER_HEADER, b"5.6.7.8:90")],  # two: which one? neither
    [],
])
def test_a_malformed_missing_or_repeated_header_leaves_no_client(headers):
    seen, _ = seen_by_app([(b"host", b"engine"), *headers])
    assert seen["client"] is None
    assert seen["headers"] == [(b"host", b"engine")]


def test_lifespan_passes_untouched():
    seen, given = seen_by_app([], scope_type="lifespan")
    assert seen == given
