"""The limits one HTTP server enforces per connection, and the pure rules computed from them."""

from __future__ import annotations

from dataclasses import dataclass

from servewell.config.server import ServerConfig


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The limits one server enforces (the matching `ServerConfig` fields)."""

    max_header_bytes: int
    max_header_count: int
    max_url_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    reserved_connections: int
    max_pipelined_requests: int = 16
    min_body_rate_bytes_s: float = 1024.0
    body_rate_grace_s: float = 2.0
    send_timeout_s: float = 30.0
    max_body_bytes: int = 1_048_576

    @classmethod
    def from_settings(cls, settings: ServerConfig) -> HttpLimits:
        """The limits configured in `settings`."""
        return cls(settings.max_header_bytes, settings.max_header_count, settings.max_url_bytes,
                   settings.header_timeout_s, settings.body_timeout_s, settings.max_connections,
                   settings.reserved_connections, settings.max_pipelined_requests, settings.min_body_rate_bytes_s,
                   settings.body_rate_grace_s, settings.send_timeout_s, settings.max_body_bytes)


def body_deadline(started_at: float, received: int, limits: HttpLimits) -> float:
    """The instant a body whose head completed at `started_at`, and which has brought `received`
    bytes since, falls behind: its timeout, or (after the grace) the moment the bytes it brought
    no longer cover `min_body_rate_bytes_s` times the time it has taken."""
    timeout_at = started_at + limits.body_timeout_s
    if limits.min_body_rate_bytes_s <= 0:
        return timeout_at
    return min(timeout_at, started_at + max(limits.body_rate_grace_s, received / limits.min_body_rate_bytes_s))


@dataclass(slots=True)
class KeepAlivePolicy:
    """Whether answers may leave their connection open: from the moment readiness turns false
    (shutdown), every answer closes its connection, so no client reuses one the listener is about
    to close (a request on it would be reset: 6 of 7,365 were, before)."""

    closing: bool = False
