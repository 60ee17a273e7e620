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

The one rule for every view of requests and tenants (issue 45, H2: `AccessRule.caller`):

- An **operator** is a caller presenting the admin token, or an API key marked `role=operator` in
  the keys file, or (with no admin token) a direct loopback client under `trust_loopback_admin`
  that presents no tenant's key. Operators see the whole server: every tenant's requests, key ids
  and figures, /admin, and /metrics.
- A caller presenting a tenant's API key is that **tenant**, wherever it connects from (loopback
  included: a key says who the caller is): it sees its own tenant's requests, counts and quotas,
  never another tenant's nor any key id but its own tenant's. Asking for another tenant's is 403
  (`Forbidden`, naming the rule) whether that tenant exists or not.
- A credential that is neither the admin token nor a key in force makes no operator, from
  loopback either (401): fail closed.
- With no keys configured there are no tenants: the rule is the admin rule above, as before.
"""

from __future__ import annotations

import copy
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from servewell.api.keys import InferenceAccess, presented_key
from servewell.errors import Forbidden, ServeError, Unauthorized
from servewell.tenancy.keys import ApiKey, KeyRing

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
    `trust_loopback` (`Forbidden` otherwise). The rule without API keys: `AccessRule` adds them."""
    AccessRule(admin_token, trust_loopback, KeyRing()).caller(authorization, None, client_host,
                                                              proxied=proxied).require_operator()


class OperatorSettings(Protocol):
    """What the rule reads of the server's settings (`ServerConfig` has both)."""

    @property
    def admin_token(self) -> str | None: ...

    @property
    def trust_loopback_admin(self) -> bool: ...


_OPERATOR_HOW = "the admin token ('Authorization: Bearer <admin_token>') or an operator key (role=operator)"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is, by `AccessRule`: an operator, a tenant (the key it presented), or neither."""

    operator: bool
    #: The API key the caller presented and the keys in force name (None: none, or no keys configured).
    key: ApiKey | None
    #: Why the caller is not an operator (None for an operator): what `require_operator` raises.
    denial: ServeError | None = None

    @property
    def tenant(self) -> str | None:
        """The tenant of the caller's key; None for a caller without one (operators included)."""
        return self.key.tenant_id if self.key is not None and not self.operator else None

    def require_operator(self) -> None:
        """Return for an operator; raise why not otherwise (401 without credentials where a token
        is configured, 403 for a tenant's key or an address the rule does not trust)."""
        if self.denial is not None:
            # A copy: the original raised here would hold this frame (its traceback), and the
            # frame this caller, and the caller the original: a cycle per refused request, freed
            # only by the cyclic collector (api/remote_engine.py's `admit` says what that cost).
            raise copy.copy(self.denial)


class AccessRule:
    """The one access rule (the module docstring): built per request from the settings and the
    keys in force (cheap: three references), so a keys-file reload applies at the next request."""

    __slots__ = ("_admin_token", "_keys", "_trust_loopback")

    def __init__(self, admin_token: str | None, trust_loopback: bool, keys: KeyRing) -> None:
        self._admin_token = admin_token
        self._trust_loopback = trust_loopback
        self._keys = keys

    def caller(self, authorization: str | None, api_key: str | None, client_host: str | None, *,
               proxied: bool) -> Caller:
        """Who presents `Authorization` / `X-API-Key` (gRPC: the same metadata) from `client_host`
        (`proxied`: `came_through_proxy` of its header names)."""
        token = self._admin_token
        if token and authorization is not None and hmac.compare_digest(authorization.encode(),
                                                                         f"Bearer {token}".encode()):
            return Caller(True, None)
        presented = self._presented(authorization, api_key)
        key = self._keys.identify(presented) if presented else None
        if presented and key is None:  # a credential that is nobody's is no loopback operator either: fail closed
            return Caller(False, None, Unauthorized("the credential is neither the admin token nor a valid API key"))
        if key is not None:
            if key.operator:
                return Caller(True, key)
            return Caller(False, key, Forbidden(
                f"API key '{key.id}' belongs to tenant '{key.tenant_id}', which sees its own requests and figures "
                f"only: the whole server's (every tenant's, /admin, /metrics) need {_OPERATOR_HOW}"))
        if token:
            return Caller(False, None, Unauthorized(f"this endpoint needs {_OPERATOR_HOW}"))
        if not self._trust_loopback:
            return Caller(False, None, Forbidden(
                "admin endpoints need admin_token or an operator key, and no token is configured "
                "(trust_loopback_admin is off)"))
        if proxied:
            return Caller(False, None, Forbidden(
                "admin endpoints answer a request that came through a proxy only with admin_token or an operator "
                "key, and no token is configured"))
        if not is_loopback(client_host):
            return Caller(False, None, Forbidden(
                "admin endpoints answer loopback clients only unless admin_token is configured (or with an "
                "operator key)"))
        return Caller(True, None)

    def _presented(self, authorization: str | None, api_key: str | None) -> str | None:
        # The key middleware's reading of the credentials (api/keys.py, `InferenceAccess.check`), without
        # counting or spending a rate token: this only says who the caller is. No keys configured: a
        # key-shaped header means nothing, as before keys existed.
        if not self._keys.enabled:
            return None
        return presented_key(authorization, api_key)


def access_rule(settings: OperatorSettings, access: InferenceAccess) -> AccessRule:
    """The rule of `settings` (its `admin_token` and `trust_loopback_admin`) with `access`'s keys in force now."""
    return AccessRule(settings.admin_token, settings.trust_loopback_admin, access.ring)


def grpc_peer_host(peer: str) -> str | None:
    """The host of a gRPC peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`); None for others."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return None
