"""Tenants (issue 22): who is calling, as the engine sees it, with a weight and quotas.

A tenant is an API key, or the keys that name the same `tenant=` in the keys file
(tenancy/keys.py); requests without a key (no keys configured) are the one anonymous tenant "".
This lives in the engine process, one per server, so quotas hold across every ingress process:

* **rate** (`rate=`, else the server's `api_key_rate_per_s`): a token bucket per tenant, bursts up
  to one second's worth; the only rate limit (an ingress process checks none of its own);
* **concurrency** (`concurrency=`): requests admitted and not yet answered, all models together;
* **queue** (`queue=`): requests waiting in one model's queue.

Over a quota is 429 `over_quota` with a `Retry-After` (a model's own full queue stays 503
`overloaded`): the tenant must slow down, the server is not full. The weight (`weight=`) is the
tenant's share of a model's batches when tenants compete (engine/batch_queue.py).

The policies are rebuilt when the keys in force change (a keys-file reload, applied live); a
tenant's counters and bucket survive a reload that keeps it. Metric labels are tenant ids from
the keys file (bounded by the configuration, never by a client); "" is shown as "-".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from servewell.errors import NotFound, OverQuota, quote
from servewell.observability.metrics import ServeMetrics
from servewell.tenancy.keys import KeyRing, policies_of
from servewell.tenancy.policy import ANONYMOUS, TenantPolicy, tenant_label

TENANT_RESULTS = ("admitted", "over_rate", "over_concurrency", "over_queue", "failed")


class Tenants:
    """The tenants of the keys in force: quotas checked per request, counts kept per tenant."""

    def __init__(self, ring: Callable[[], KeyRing | None] = lambda: None, metrics: ServeMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 default_rate: Callable[[], float | None] = lambda: None) -> None:
        self._ring = ring
        #: The rate of a tenant whose keys name none (`api_key_rate_per_s`, live).
        self._default_rate = default_rate
        self._rate_seen: float | None = None
        self._seen: KeyRing | None = None
        self._file: dict[str, TenantPolicy] = {}  # per key id, as the keys file says
        self._overrides: dict[str, dict[str, Any]] = {}  # per tenant, from the admin API
        self._by_key: dict[str, TenantPolicy] = {}  # per key id, the policy in force
        self._by_tenant: dict[str, TenantPolicy] = {}  # per tenant id, the same policies
        self._weights: dict[str, float] = {}
        self._anonymous = TenantPolicy(ANONYMOUS)
        self._metrics = metrics
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill)
        self.inflight: dict[str, int] = {}
        self.counts: dict[str, dict[str, int]] = {}

    def _refresh(self) -> None:
        ring = self._ring()
        rate = self._default_rate()
        if ring is self._seen and rate == self._rate_seen:
            return
        self._seen, self._rate_seen = ring, rate
        self._file = policies_of(ring, rate) if ring is not None else {}
        self._overrides.clear()  # the file changed: it wins, as model.yaml does over batching changes
        self._apply()
        tenants = set(self._weights) | {ANONYMOUS}
        for table in (self._buckets, self.counts):
            for gone in [t for t in table if t not in tenants]:
                del table[gone]

    def _apply(self) -> None:
        changed = {p.id: dataclasses.replace(p, **self._overrides[p.id]) for p in self._file.values()
                   if p.id in self._overrides}
        self._by_key = {key: changed.get(p.id, p) for key, p in self._file.items()}
        self._by_tenant = {p.id: p for p in self._by_key.values()}
        self._weights = {p.id: p.weight for p in self._by_key.values()}

    def update(self, tenant: str, changes: dict[str, Any]) -> dict[str, Any]:
        """An admin's live change of a tenant's weight or quotas (a None value: back to the keys
        file's). It lasts until the keys file changes or the server restarts; `NotFound` for a
        tenant the keys file does not name. Returns the tenant as `report` shows it."""
        self._refresh()
        if tenant not in self._weights:
            raise NotFound(f"no tenant {quote(tenant)} in the keys in force")
        merged = {**self._overrides.get(tenant, {}), **changes}
        self._overrides[tenant] = {k: v for k, v in merged.items() if v is not None}
        self._apply()
        return next(t for t in self.report() if t["tenant"] == tenant)

    @property
    def enabled(self) -> bool:
        """Whether keys are in force (without them every request is the anonymous tenant, which has
        no quota and the one weight: the engine then skips tenants altogether, at no cost)."""
        self._refresh()
        return self._seen is not None

    def keys_of(self, tenant: str) -> frozenset[str]:
        """The key ids of `tenant` ("-": requests without a key)."""
        self._refresh()
        if tenant == tenant_label(ANONYMOUS):
            return frozenset({""})
        return frozenset(key for key, policy in self._by_key.items() if policy.id == tenant)

    def of(self, key_id: str) -> TenantPolicy:
        """The policy of the tenant whose key is `key_id` ("" or an unknown id: anonymous)."""
        self._refresh()
        return self._by_key.get(key_id, self._anonymous) if key_id else self._anonymous

    def policy(self, tenant: str) -> TenantPolicy:
        """The policy of tenant `tenant` (a request carries its tenant id; "" or an unknown id:
        the anonymous tenant's)."""
        self._refresh()
        return self._by_tenant.get(tenant, self._anonymous) if tenant else self._anonymous

    def weight(self, tenant: str) -> float:
        """A tenant's weight (1 for one not configured)."""
        self._refresh()
        return self._weights.get(tenant, 1.0)

    def admit(self, policy: TenantPolicy, queued: int, model: str) -> None:
        """Count one request of `policy`'s tenant in, or raise `OverQuota`; `queued`: its requests
        waiting in `model`'s queue now. Pair every admit with `release`."""
        if policy.limited:
            self._check(policy, queued, model)
        tenant = policy.id
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
        self._count(tenant, "admitted")

    def release(self, tenant: str, started: float) -> None:
        """A request admitted for `tenant` at `started` (this clock) was answered."""
        self.inflight[tenant] -= 1
        if self._metrics is not None:
            self._metrics.tenant_duration.labels(tenant_label(tenant)).observe(self._clock() - started)

    def _check(self, policy: TenantPolicy, queued: int, model: str) -> None:
        tenant, name = policy.id, tenant_label(policy.id)
        if policy.max_concurrent is not None and self.inflight.get(tenant, 0) >= policy.max_concurrent:
            self._count(tenant, "over_concurrency")
            raise OverQuota(f"tenant '{name}' has {policy.max_concurrent} requests in progress, its concurrency "
                            "quota; retry once one is answered", retry_after_s=1.0)
        if policy.max_queued is not None and queued >= policy.max_queued:
            self._count(tenant, "over_queue")
            raise OverQuota(f"tenant '{name}' has {queued} requests queued for model '{model}', its queue quota",
                            retry_after_s=1.0)
        if policy.rate_per_s is not None:
            rate, now = policy.rate_per_s, self._clock()
            burst = max(1.0, rate)
            tokens, last = self._buckets.get(tenant, (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[tenant] = (tokens, now)
                self._count(tenant, "over_rate")
                raise OverQuota(f"tenant '{name}' is over its rate of {rate:g} requests per second",
                                retry_after_s=(1.0 - tokens) / rate)
            self._buckets[tenant] = (tokens - 1.0, now)

    def count_outcome(self, tenant: str, result: str) -> None:
        """Count a request of `tenant` that failed (an error that is not a refusal)."""
        self._count(tenant, result)

    def refused_counts(self) -> dict[str, int]:
        """Refusals (429, 503) per tenant id, whichever process refused them: from the merged
        `servewell_refusals_total` (an ingress refuses a full lane's requests before the engine
        sees them); quota refusals are counted apart (over_rate, ...) and left out here."""
        if self._metrics is None:
            return {}
        totals: dict[str, int] = {}
        for (_, _, label, reason), value in self._metrics.refusals.snapshot():
            if reason != "over_quota":
                tenant = ANONYMOUS if label == tenant_label(ANONYMOUS) else label
                totals[tenant] = totals.get(tenant, 0) + int(value)
        return totals

    def _count(self, tenant: str, result: str) -> None:
        counts = self.counts.get(tenant)
        if counts is None:
            counts = self.counts[tenant] = dict.fromkeys(TENANT_RESULTS, 0)
        counts[result] += 1
        if self._metrics is not None:
            self._metrics.tenant_requests.labels(tenant_label(tenant), result).inc()

    def report(self) -> list[dict[str, Any]]:
        """Every configured tenant (and the anonymous one once it sent a request): policy, requests
        in progress and counts by result since the server started."""
        self._refresh()
        policies = {p.id: p for p in self._by_key.values()}
        if ANONYMOUS in self.counts:
            policies.setdefault(ANONYMOUS, self._anonymous)
        refused = self.refused_counts()
        return [{"tenant": tenant_label(t), "weight": p.weight, "rate_per_s": p.rate_per_s,
                 "max_concurrent": p.max_concurrent, "max_queued": p.max_queued,
                 "overrides": dict(self._overrides.get(t, {})),
                 "inflight": self.inflight.get(t, 0), **self.counts.get(t, dict.fromkeys(TENANT_RESULTS, 0)),
                 "refused": refused.get(t, 0)}
                for t, p in sorted(policies.items())]
