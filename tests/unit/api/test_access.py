"""Who may use the admin endpoints and the whole server's views: the token or an operator key, else a
loopback client that reached servewell directly and presents no tenant's key; a tenant's key is its tenant."""

from __future__ import annotations

import pytest

from servewell.api.access import AccessRule, Caller, came_through_proxy, check_admin, grpc_peer_host, is_loopback
from servewell.errors import Forbidden, Unauthorized
from servewell.tenancy.keys import KeyRing, parse_keys


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


# ---------- the one rule with API keys (issue 45, H2) ----------

TENANT_A = "tenant-a-secret-0123456789"
TENANT_B = "tenant-b-secret-0123456789"
OPERATOR = "operator-secret-0123456789"
RING = KeyRing(parse_keys([f"a1:{TENANT_A} tenant=a", f"b1:{TENANT_B} tenant=b",
                           f"ops:{OPERATOR} role=operator"], "keys.txt"))


def caller(token: str | None = None, authorization: str | None = None, api_key: str | None = None,
           host: str | None = "127.0.0.1", *, proxied: bool = False, trust_loopback: bool = True,
           ring: KeyRing = RING) -> Caller:
    return AccessRule(token, trust_loopback, ring).caller(authorization, api_key, host, proxied=proxied)


def test_a_tenants_key_is_that_tenant_even_on_loopback_with_no_admin_token() -> None:
    # Issue 45: with keys and no token, tenant b on 127.0.0.1 was "admin" and read tenant a's requests.
    for who in (caller(api_key=TENANT_B), caller(authorization=f"Bearer {TENANT_B}")):
        assert not who.operator and who.tenant == "b" and who.key is not None and who.key.id == "b1"
        with pytest.raises(Forbidden, match="tenant 'b'.*operator key"):
            who.require_operator()


def test_an_operator_key_opens_what_the_admin_token_opens_and_belongs_to_no_tenant() -> None:
    for who in (caller("s3cret", api_key=OPERATOR, host="203.0.113.9", proxied=True),
                caller(authorization=f"Bearer {OPERATOR}", host="10.0.0.8", trust_loopback=False)):
        assert who.operator and who.tenant is None
        who.require_operator()


def test_the_admin_token_wins_over_a_tenants_key_sent_beside_it() -> None:
    # The console sends the API key as X-API-Key and the admin token as Authorization, together.
    who = caller("s3cret", authorization="Bearer s3cret", api_key=TENANT_A, host="203.0.113.9")
    assert who.operator and who.tenant is None


def test_without_a_key_the_admin_rule_is_as_before() -> None:
    assert caller().operator  # loopback, no token, trusted
    assert not caller(host="10.0.0.8").operator and not caller(proxied=True).operator
    with pytest.raises(Unauthorized):
        caller("s3cret").require_operator()
    assert not caller(api_key="not-any-configured-key-at-all", host="10.0.0.8").operator
    with pytest.raises(Unauthorized, match="neither the admin token nor a valid API key"):  # loopback too
        caller(authorization="Bearer not-any-configured-key-at-all").require_operator()
    # No keys configured: a key-shaped header is nobody's, and loopback stays trusted.
    assert caller(api_key=TENANT_B, ring=KeyRing()).operator
    assert caller(api_key=TENANT_B, ring=KeyRing()).tenant is None


def test_a_revoked_operator_key_opens_nothing_at_the_next_request() -> None:
    ring = KeyRing(parse_keys([f"b1:{TENANT_B} tenant=b"], "keys.txt"))  # ops removed from the file
    who = caller("s3cret", api_key=OPERATOR, host="10.0.0.8", ring=ring)
    assert not who.operator and who.tenant is None
    with pytest.raises(Unauthorized):
        who.require_operator()
