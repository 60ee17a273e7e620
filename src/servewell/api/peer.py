"""The client's address across the ingress → engine hop: `x-servewell-peer`.

An ingress process forwards every request it does not serve itself to the engine's private
HTTP app (`api/forward.py`). The engine sees the ingress as its peer, so the ingress names the
real client in `x-servewell-peer: <ip>:<port>` (`[<ipv6>]:<port>` for IPv6), always written by
the ingress itself: a client-supplied header of that name is dropped there, never passed on.

`TrustedPeerMiddleware`, on the engine's internal app, turns the header back into
`scope["client"]`, so logs, the console and anything that reads the client's address see the
client as they did in the one-process server, and removes it, so nothing downstream sees it.

It is safe ONLY on an app that listens on the private unix socket in the supervisor's run
directory (mode 0700, owned by the server's user): every connection to it comes from an
ingress, which overwrote the header. On any socket a client can reach, a client would choose
its own address by sending the header: never install it there.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

#: The header that carries the client's address from an ingress to the engine.
PEER_HEADER = b"x-servewell-peer"

# `[` + the longest IPv6 text with a zone id (45 + '%' + IFNAMSIZ-1) + `]:65535`: anything longer is not an address.
_MAX_PEER_BYTES = 72


def format_peer(client: object) -> bytes | None:
    """The header value for an ASGI `scope["client"]`, `(host, port)` (None when there is no
    client address, as for a unix-socket connection)."""
    if not isinstance(client, (tuple, list)) or len(client) != 2:
        return None
    host, port = client
    if not isinstance(host, str) or not host or not isinstance(port, int):
        return None
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return text.encode("ascii", "replace")


def parse_peer(value: bytes) -> tuple[str, int] | None:
    """`(host, port)` from a header value, or None unless it is exactly an IPv4 address or a
    bracketed IPv6 address, a colon and a decimal port 0-65535 (no names, no spaces, no signs)."""
    if len(value) > _MAX_PEER_BYTES:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    host, colon, port_text = text.rpartition(":")
    if not colon or not port_text.isdecimal() or len(port_text) > 5:
        return None
    port = int(port_text)
    if port > 65535:
        return None
    try:
        if host.startswith("[") and host.endswith("]"):
            address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host[1:-1])
        else:
            address = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    return str(address), port


class TrustedPeerMiddleware:
    """Sets `scope["client"]` from `x-servewell-peer` and removes the header (see the module
    docstring: only on the engine's private socket). No header, several, or a malformed one:
    `client` is None, as for any unix-socket connection; the header is removed all the same."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        values = [value for name, value in headers if name == PEER_HEADER]
        scope = dict(scope)
        scope["client"] = parse_peer(values[0]) if len(values) == 1 else None
        if values:
            scope["headers"] = [(name, value) for name, value in headers if name != PEER_HEADER]
        await self.app(scope, receive, send)
