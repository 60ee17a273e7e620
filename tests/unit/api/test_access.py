"""Who may use the admin endpoints: the token, else a loopback client that reached servewell directly."""

from __future__ import annotations

import pytest

from servewell.api.access import came_through_proxy, check_admin, grpc_peer_host, is_loopback
from servewell.errors import Forbidden, Unauthorized


def allowed(token: str | None = None, authorization: str | None = None, host: str | None = "127.0.0.1", *,
            proxied: bool = False, trust_loopback: bool = True) -> bool:
    try:
        check_admin(token, authorization, host, proxied=proxied, trust_loopback=trust_loopback)
    except (Forbidden, Unauthorized):
        return False
    return True


def test_with_a_token_only_the_token_counts_wherever_the_request_comes_from() -> None:
    assert allowed("s3cret", "Bearer s3cret", "203.0.113.9", proxied=True)
    assert allowed("s3cret", "Bearer s3cret", trust_loopback=False)
    with pytest.raises(Unauthorized):
        check_admin("s3cret", None, "127.0.0.1", proxied=False, trust_loopback=True)
    assert not allowed("s3cret", "Bearer wrong")


def test_without_a_token_a_direct_loopback_client_is_admin() -> None:
    assert allowed(host="127.0.0.1") and allowed(host="::1") and allowed(host="127.3.2.1")
    assert not allowed(host="10.0.0.8") and not allowed(host=None)


def test_a_loopback_client_that_came_through_a_proxy_is_not_admin() -> None:
    # HAProxy on the same host connects from 127.0.0.1 for whoever reached it (issue 19.5).
    with pytest.raises(Forbidden, match="proxy"):
        check_admin(None, None, "127.0.0.1", proxied=True, trust_loopback=True)


def test_with_trust_loopback_off_admin_needs_the_token() -> None:
    with pytest.raises(Forbidden, match="trust_loopback_admin"):
        check_admin(None, None, "127.0.0.1", proxied=False, trust_loopback=False)


@pytest.mark.parametrize("header", ["X-Forwarded-For", "x-forwarded-for", "Forwarded", "Via", "X-Real-IP",
                                    "X-Forwarded-Host", "X-Forwarded-Proto"])
def test_headers_that_proxies_add_mark_a_request_as_proxied(header: str) -> None:
    assert came_through_proxy(["host", "accept", header])


def test_a_plain_request_is_not_proxied() -> None:
    assert not came_through_proxy(["host", "accept", "authorization", "content-type", "x-request-id"])
    assert not came_through_proxy([])


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("127.evil.example") and not is_loopback("::2") and not is_loopback("192.168.1.1")
    assert not is_loopback(None)


def test_grpc_peer_hosts() -> None:
    assert grpc_peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert grpc_peer_host("ipv6:[::1]:5000") == "::1"
    assert grpc_peer_host("unix:/tmp/s") is None
