"""Who may call the operator endpoints (HTTP `/admin`, the repository extension, their gRPC twins)."""

from __future__ import annotations

import hmac

from servewell.errors import Forbidden, Unauthorized

_LOOPBACK = ("127.", "::1", "localhost")


def check_admin(admin_token: str | None, authorization: str | None, client_host: str | None) -> None:
    """Allow the configured bearer token (`Unauthorized` otherwise); with no token configured,
    loopback clients only (`Forbidden` otherwise)."""
    if admin_token:
        given = (authorization or "").encode()
        if not hmac.compare_digest(given, f"Bearer {admin_token}".encode()):
            raise Unauthorized("this endpoint needs 'Authorization: Bearer <admin_token>'")
    elif client_host is None or not client_host.startswith(_LOOPBACK):
        raise Forbidden("admin endpoints answer loopback clients only unless admin_token is configured")


def grpc_peer_host(peer: str) -> str | None:
    """The host of a gRPC peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`); None for others."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return None
