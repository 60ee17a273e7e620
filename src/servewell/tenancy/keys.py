"""API keys: who may call, and the tenant each key belongs to (its quotas are enforced in the engine:
engine/tenants.py; the HTTP side that reads a key from a request is api/keys.py).

Keys come from a file (`--api-keys-file`, one per line) and/or `SERVEWELL_API_KEYS` (comma
separated), in the same entry format:

    <key>                          a key; its id is derived from its hash (key-1a2b3c4d)
    <id>:<key>                     a key with an id (letters, digits, '-', '_', '.')
    <id>:sha256:<64 hex digits>    only the key's SHA-256 is stored, not the key
    ... rate=<n>                   optional: the request rate of the key's tenant, per second (one
                                   bucket per tenant for the whole server; default api_key_rate_per_s)

and, for tenants (issue 22; engine/tenants.py enforces them in the engine, for the whole server):

    ... tenant=<id>                the tenant the key belongs to (default: the key's id); keys
                                   of one tenant share its weight and quotas
    ... weight=<w>                 its share of a model's batches when tenants compete (default 1)
    ... concurrency=<n>            its requests admitted and not yet answered, at most (all models)
    ... queue=<n>                  its requests queued per model, at most

and, for operators (issue 45):

    ... role=operator              the key is an operator's: besides inference it opens what the
                                   admin token opens (/admin, /metrics and the console's whole-server
                                   view when keys are configured; api/access.py); default role=tenant

A field appears at most once on a line, and a key at most once in all the entries (under one id
or two): which of two would win is not something to guess. `#` starts a comment.

Only SHA-256 digests are kept in memory; a presented key is hashed once
and compared with every stored digest in constant time. Ids (never keys) appear in logs and as
a metric label, so their number is bounded by the configuration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from servewell.tenancy.policy import ID_RULE, MAX_QUOTA, MAX_WEIGHT, TenantPolicy, is_valid_id

#: Shortest key accepted: shorter ones are guessable.
MIN_KEY_LENGTH = 16
#: Longest credential read from a request (a header of megabytes costs no hashing).
MAX_PRESENTED_LENGTH = 512
_HEX = re.compile(r"^[0-9a-f]{64}$")


class KeyFormatError(ValueError):
    """An entry of the keys file or variable cannot be used (the message names where and why)."""


class NoKeysError(KeyFormatError):
    """Keys are configured (a keys file, SERVEWELL_API_KEYS) but yield none: never read as "open"."""


_FIELDS = ("rate", "tenant", "weight", "concurrency", "queue", "role")
#: What a key may be: a tenant's (inference, its own requests and figures) or an operator's.
ROLES = ("tenant", "operator")


@dataclass(slots=True, frozen=True)
class ApiKey:
    """One accepted key: its id, the SHA-256 of the key, its own rate limit if any, and its
    tenant's name, weight and quotas."""

    id: str
    digest: bytes
    rate_per_s: float | None = None
    tenant: str = ""  # "" : the key's id
    weight: float | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None
    operator: bool = False  # role=operator: opens the operator's views and endpoints (api/access.py)
    #: Where the entry was read ("keys.txt: entry 3"), for messages about two entries; never the key.
    where: str = dataclasses.field(default="", compare=False)

    @property
    def tenant_id(self) -> str:
        """The tenant this key's requests count against."""
        return self.tenant or self.id


def parse_keys(lines: Iterable[str], source: str) -> list[ApiKey]:
    """Keys from `lines` (a file's lines or the variable's entries); `KeyFormatError` naming the
    source and line for anything malformed. The message never contains the key itself."""
    keys: list[ApiKey] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}: entry {number}"
        fields = line.split()
        extras = _extra_fields(fields[1:], where)
        keys.append(dataclasses.replace(_parse_entry(fields[0], where, None), where=where, **extras))
    check_distinct(keys)
    _check_tenants(keys, source)
    return keys


def check_distinct(keys: Iterable[ApiKey]) -> None:
    """`KeyFormatError` when two entries (of one source or several: a keys file and
    SERVEWELL_API_KEYS) share an id, or hold the same key under two ids or tenants: the lookup
    would answer with one of them, silently (issue 45, H7). The message names both entries, never the key."""
    by_id: dict[str, ApiKey] = {}
    by_digest: dict[bytes, ApiKey] = {}
    for key in keys:
        first = by_id.setdefault(key.id, key)
        if first is not key:
            raise KeyFormatError(f"{key.where or 'an entry'}: key id '{key.id}' appears twice "
                                 f"(first at {first.where or 'another entry'})")
        first = by_digest.setdefault(key.digest, key)
        if first is not key:
            raise KeyFormatError(
                f"{key.where or 'an entry'}: the same key as {first.where or 'another entry'} (ids '{first.id}' and "
                f"'{key.id}'): one key must name one caller; give each id and tenant its own key")


def _extra_fields(fields: list[str], where: str) -> dict[str, Any]:
    """The `name=value` fields after a key, checked."""
    out: dict[str, Any] = {}
    named: set[str] = set()
    for extra in fields:
        name, sep, value = extra.partition("=")
        if not sep or name not in _FIELDS:
            raise KeyFormatError(f"{where}: unexpected field (after a key: {', '.join(f + '=' for f in _FIELDS)})")
        if name in named:
            raise KeyFormatError(f"{where}: {name}= appears twice on the line (which would win?)")
        named.add(name)
        if name == "role":
            if value not in ROLES:
                raise KeyFormatError(f"{where}: role must be {' or '.join(ROLES)}")
            out["operator"] = value == "operator"
        elif name == "tenant":
            if not is_valid_id(value):
                raise KeyFormatError(f"{where}: tenant must be {ID_RULE}")
            out["tenant"] = value
        elif name in ("rate", "weight"):
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if not (number > 0 and math.isfinite(number)) or (name == "weight" and number > MAX_WEIGHT):
                raise KeyFormatError(f"{where}: {name} must be a positive number"
                                     + (" of requests per second" if name == "rate" else f" up to {MAX_WEIGHT:g}"))
            out["rate_per_s" if name == "rate" else "weight"] = number
        else:
            if not value.isdigit() or not 1 <= int(value) <= MAX_QUOTA:
                raise KeyFormatError(f"{where}: {name} must be a whole number from 1 to {MAX_QUOTA}")
            out["max_concurrent" if name == "concurrency" else "max_queued"] = int(value)
    return out


def _check_tenants(keys: list[ApiKey], source: str) -> None:
    """Keys of one tenant must not state its weight or a quota differently (which would win?)."""
    stated: dict[tuple[str, str], tuple[object, str]] = {}
    for key in keys:
        for field_name in ("weight", "max_concurrent", "max_queued"):
            value = getattr(key, field_name)
            if value is None:
                continue
            first = stated.setdefault((key.tenant_id, field_name), (value, key.id))
            if first[0] != value:
                raise KeyFormatError(f"{source}: keys '{first[1]}' and '{key.id}' of tenant '{key.tenant_id}' give "
                                     f"its {field_name.replace('max_', '')} differently ({first[0]} and {value})")


def _parse_entry(entry: str, where: str, rate: float | None) -> ApiKey:
    if entry.count(":") >= 2 and entry.split(":", 2)[1] == "sha256":
        key_id, _, hex_digest = entry.split(":", 2)
        if not is_valid_id(key_id):
            raise KeyFormatError(f"{where}: key id must be {ID_RULE}")
        if not _HEX.match(hex_digest.lower()):
            raise KeyFormatError(f"{where}: sha256 must be 64 hexadecimal digits")
        return ApiKey(key_id, bytes.fromhex(hex_digest), rate)
    key_id, sep, secret = entry.partition(":")
    if not sep:
        key_id, secret = "", entry
    elif not is_valid_id(key_id):
        raise KeyFormatError(f"{where}: key id must be {ID_RULE}")
    if len(secret) < MIN_KEY_LENGTH:
        raise KeyFormatError(f"{where}: keys must be at least {MIN_KEY_LENGTH} characters")
    digest = hashlib.sha256(secret.encode()).digest()
    return ApiKey(key_id or f"key-{digest.hex()[:8]}", digest, rate)


def key_digest(secret: str) -> str:
    """The `sha256:` form of a key, for writing hashed entries (`servewell keys hash`)."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


class KeyRing:
    """The accepted keys; swapped whole when the configuration is reloaded. `required` with no
    keys denies everyone: what a reload to zero keys leaves (keys never fail open)."""

    def __init__(self, keys: Iterable[ApiKey] = (), required: bool = False) -> None:
        self._keys = tuple(keys)
        self._required = required
        self._tenants = {key.id: key.tenant_id for key in self._keys}

    def tenant_of(self, key_id: str) -> str:
        """The tenant id of key `key_id` ("" for no key or an id not in force: the anonymous tenant)."""
        return self._tenants.get(key_id, "") if key_id else ""

    @property
    def enabled(self) -> bool:
        """Whether a key is required (keys configured, or every key revoked: nobody gets in)."""
        return self._required or bool(self._keys)

    @property
    def ids(self) -> tuple[str, ...]:
        """Ids of the accepted keys."""
        return tuple(k.id for k in self._keys)

    @property
    def keys(self) -> tuple[ApiKey, ...]:
        """The accepted keys (their digests, ids, limits and tenants)."""
        return self._keys

    def identify(self, presented: str) -> ApiKey | None:
        """The key `presented` matches, or None. Every stored digest is compared, whichever matches."""
        if not presented or len(presented) > MAX_PRESENTED_LENGTH:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found: ApiKey | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def policies_of(ring: KeyRing, default_rate_per_s: float | None = None) -> dict[str, TenantPolicy]:
    """Each key id's tenant policy (keys of one tenant share it; `parse_keys` checked they agree);
    a tenant whose keys name no rate gets `default_rate_per_s`."""
    by_tenant: dict[str, dict[str, Any]] = {}
    owners: dict[str, str] = {}
    for key in ring.keys:
        fields = by_tenant.setdefault(key.tenant_id, {})
        for name, value in (("weight", key.weight), ("rate_per_s", key.rate_per_s),
                            ("max_concurrent", key.max_concurrent), ("max_queued", key.max_queued)):
            if value is not None:
                fields.setdefault(name, value)
        owners[key.id] = key.tenant_id
    if default_rate_per_s is not None:
        for fields in by_tenant.values():
            fields.setdefault("rate_per_s", default_rate_per_s)
    policies = {tenant: TenantPolicy(tenant, **fields) for tenant, fields in by_tenant.items()}
    return {key_id: policies[tenant] for key_id, tenant in owners.items()}
