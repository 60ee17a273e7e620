"""Who may call the operator endpoints (HTTP `/admin`, the repository extension, their gRPC twins,
and the admin part of the console's state).

The rule: the configured `admin_token` as a bearer token; with no token configured, a client on
this machine that reached servewell directly, and only while `trust_loopback_admin` is on.

A request that came through a proxy is never "a client on this machine", although its connection
comes from the proxy's address (127.0.0.1 for a proxy on the same host): through deploy/local's
HAProxy, anyone who could reach HAProxy could unload models and read the console's recent requests
as admin (issue 19.5). A request carrying a header that proxies add (`Forwarded`, `X-Forwarded-*`,
`X-Real-IP`, `Via`) is taken as proxied. That is a second line of defence only: a proxy that adds
none of them (a plain TCP forwarder, a misconfigured one) cannot be recognised, so wherever a proxy
is in front, set `admin_token` (or `trust_loopback_admin: false`); the shipped configs set a token.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from servewell.errors import Forbidden, Unauthorized

#: Headers (lower case) that proxies and load balancers add to what they forward (RFC 7239's
#: `Forwarded`, the de-facto `X-Forwarded-For/-Host/-Proto/-Port`, nginx's `X-Real-IP`, HTTP's `Via`).
PROXY_HEADERS = frozenset(
    ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-forwarded-port", "x-real-ip", "via")
)


def came_through_proxy(header_names: Iterable[str]) -> bool:
    """Whether a request with these header (or gRPC metadata) names was forwarded by a proxy."""
    return any(name.lower() in PROXY_HEADERS for name in header_names)


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a client address) is this machine's loopback (127.0.0.0/8, ::1, ::ffff:127.x)."""
    if host is None:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check_admin(admin_token: str | None, authorization: str | None, client_host: str | None, *,
                proxied: bool, trust_loopback: bool) -> None:
    """Allow the configured bearer token (`Unauthorized` otherwise). With no token configured:
    a loopback client that did not come through a proxy (`proxied`), and only when
    `trust_loopback` (`Forbidden` otherwise)."""
    if admin_token:
        given = (authorization or "").encode()
        if not hmac.compare_digest(given, f"Bearer {admin_token}".encode()):
            raise Unauthorized("this endpoint needs 'Authorization: Bearer <admin_token>'")
        return
    if not trust_loopback:
        raise Forbidden("admin endpoints need admin_token, and none is configured (trust_loopback_admin is off)")
    if proxied:
        raise Forbidden("admin endpoints answer a request that came through a proxy only with admin_token, "
                        "and none is configured")
    if not is_loopback(client_host):
        raise Forbidden("admin endpoints answer loopback clients only unless admin_token is configured")


def grpc_peer_host(peer: str) -> str | None:
    """The host of a gRPC peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`); None for others."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return None
