"""The HTTP side of the API keys: reading the key a request presents (`Authorization: Bearer <key>`
or `X-API-Key: <key>`), answering 401 with the challenge, and counting what was presented.

The keys themselves (the keys file's format, `KeyRing`, the tenants they name) are
`servewell.tenancy`, which the engine reads too; how often a tenant may call is its quota,
enforced by the engine (engine/tenants.py).
"""

from __future__ import annotations

from servewell.errors import Unauthorized
from servewell.observability.metrics import ServeMetrics
from servewell.tenancy.keys import KeyRing


def presented_key(authorization: str | None, api_key: str | None) -> str | None:
    """The key a caller presents: `X-API-Key`, else the credential of `Authorization: Bearer`
    (any other scheme presents none); None when there is none."""
    presented = api_key
    if presented is None and authorization is not None:
        scheme, _, credential = authorization.partition(" ")
        presented = credential.strip() if scheme.lower() == "bearer" else None
    return presented or None


class InferenceAccess:
    """The API-key check every protocol runs before inference and model queries.

    `check` answers with the caller's key id, or raises `Unauthorized` (401, with the
    `WWW-Authenticate` challenge). Rates are not checked here: a key's `rate=` (or the server's
    `api_key_rate_per_s`) is its tenant's, one bucket per tenant for the whole server, checked by
    the engine's admission chain (engine/tenants.py): one limiter per quota, one 429 code
    (`over_quota`). `replace` swaps the keys live (config reload).
    """

    def __init__(self, ring: KeyRing, default_rate_per_s: float | None = None,
                 metrics: ServeMetrics | None = None) -> None:
        self._ring = ring
        self._default_rate = default_rate_per_s
        self._metrics = metrics

    @property
    def enabled(self) -> bool:
        """Whether keys are required (any configured)."""
        return self._ring.enabled

    @property
    def ids(self) -> tuple[str, ...]:
        """Ids of the keys in force."""
        return self._ring.ids

    @property
    def ring(self) -> KeyRing:
        """The keys in force (what a config reload passes on to the ingress processes)."""
        return self._ring

    @property
    def default_rate_per_s(self) -> float | None:
        """The request rate of a key that names none."""
        return self._default_rate

    def key_id_of(self, authorization: str | None, api_key: str | None) -> str:
        """The id of the key a caller presents, or "" (none, not valid, or no keys): no counting,
        no refusal (`check` does both when the request is served)."""
        if not self._ring.enabled:
            return ""
        presented = presented_key(authorization, api_key)
        key = self._ring.identify(presented) if presented else None
        return key.id if key is not None else ""

    def tenant_of(self, key_id: str) -> str:
        """The tenant of the key id `check` answered ("" without keys)."""
        return self._ring.tenant_of(key_id)

    def replace(self, ring: KeyRing, default_rate_per_s: float | None) -> None:
        """Use new keys and limits from now on (a removed key is refused at its next request)."""
        self._ring, self._default_rate = ring, default_rate_per_s

    def check(self, authorization: str | None, api_key: str | None) -> str | None:
        """The key id of a caller presenting `Authorization: Bearer <key>` or `X-API-Key: <key>`;
        None when no keys are configured."""
        ring = self._ring
        if not ring.enabled:
            return None
        presented = presented_key(authorization, api_key)
        if not presented:
            self._count_failure("missing")
            raise Unauthorized("this endpoint needs an API key: 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                               challenge='Bearer realm="servewell"')
        key = ring.identify(presented)
        if key is None:
            self._count_failure("invalid")
            raise Unauthorized("the API key is not valid",
                               challenge='Bearer realm="servewell", error="invalid_token"')
        self._count(key.id, "allowed")
        return key.id

    def _count(self, key_id: str, result: str) -> None:
        if self._metrics is not None:
            self._metrics.api_key_requests.labels(key_id, result).inc()

    def _count_failure(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.auth_failures.labels(reason).inc()
