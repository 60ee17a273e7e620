"""A tenant as a policy: its id, weight and quotas, and the rules every tenant id follows.

A tenant is an API key, or the keys that name the same `tenant=` in the keys file (tenancy/keys.py);
requests without a key (no keys configured) are the one anonymous tenant `ANONYMOUS`. The engine
enforces the quotas (engine/tenants.py); the admin API changes them within the same bounds
(api/routes_tenants.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The anonymous tenant: requests that presented no key (the server has none configured).
ANONYMOUS = ""
#: What a key id and a tenant id may be: they appear in logs and as metric labels, so they are short
#: and plain, and their number is bounded by the configuration (never by a client).
ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: How `ID_PATTERN` reads in a message.
ID_RULE = "1-64 letters, digits, '-', '_' or '.'"
#: Bounds of the tenant fields: a weight from 1/1000 to 1000 of another's; quotas a server can hold.
MAX_WEIGHT = 1000.0
MAX_QUOTA = 1_000_000


def is_valid_id(text: str) -> bool:
    """Whether `text` may be a key id or a tenant id (`ID_PATTERN`)."""
    return ID_PATTERN.match(text) is not None


def tenant_label(tenant: str) -> str:
    """A tenant id as a metric label and in documents ("-" for the anonymous tenant)."""
    return tenant or "-"


@dataclass(slots=True, frozen=True)
class TenantPolicy:
    """A tenant's weight and quotas (None: no limit)."""

    id: str
    weight: float = 1.0
    rate_per_s: float | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None

    @property
    def limited(self) -> bool:
        """Whether any quota applies (an unlimited tenant costs a request nothing here)."""
        return self.rate_per_s is not None or self.max_concurrent is not None or self.max_queued is not None
