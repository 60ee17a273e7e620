"""The audit trail: every change to what the server serves, with when, who, what, old and new.

Recorded where the change is applied, in the engine process (one trail per server):

- the admin API (batching, traffic weights, response caches, tenants, loads and unloads, the
  model pool), through the control plane's change operations, which carry the caller's identity
  (`actor`: `key <id>` for an operator key, `admin` for the admin token or a trusted loopback
  client; never the token or the key itself);
- file reloads (`live_config.py`): the `--config` file's live settings, the API keys file (key ids
  added, removed or changed: never a key), every `model.yaml` (what changed and what happened);
  who is `file`, or `SIGHUP` when the signal asked for the check;
- automatic rollbacks and promotions of a traffic split (who: `rollout rules`), seen by the console
  feed's tick as a split's state turning `rolled_back` or `promoted`, with the time it changed.

Each change is one log line (`event: audit`, INFO) and one entry in a bounded ring (`CAPACITY`
entries, each value cut to `MAX_VALUE_CHARS`): `GET /admin/audit` and the console's timeline read
it. It never holds a secret: a setting whose name says it is one (`SECRET_NAMES`) or whose value is
a pydantic `SecretStr` is shown as `(set)`, `(unset)` or `(changed)`, and the keys file is recorded
by key ids and fields only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from pydantic import BaseModel, SecretStr

log = logging.getLogger("servewell.audit")

#: Changes kept in memory (a change is at most a few KB: the ring stays under about 2 MB).
CAPACITY = 500
#: A value longer than this (as JSON) is cut, with the cut said.
MAX_VALUE_CHARS = 1000
#: A setting whose name ends with one of these holds a secret: its value is never recorded.
SECRET_NAMES = ("token", "secret", "password", "api_keys", "webhook_url", "authorization")

#: Who changed something, when it was not a caller of the admin API.
BY_FILE = "file"
BY_SIGHUP = "SIGHUP"
BY_RULES = "rollout rules"
#: What the trail says of a secret instead of its value.
_MARKERS = ("(set)", "(unset)", "(changed)")


@dataclass(slots=True, frozen=True)
class AuditEntry:
    """One change: `at` (Unix time), `who` (`key <id>`, `admin`, `file`, `SIGHUP`, `rollout rules`),
    `via` (admin API, file reload, automatic), `what` (settings, keys, model file, batching, traffic,
    cache, tenant, model, pool), `target` (a model, a tenant, a file; "" for the server), `old` and
    `new` (JSON-ready, secrets left out), and a one-line `summary`."""

    at: float
    who: str
    via: str
    what: str
    target: str
    old: Any
    new: Any
    summary: str

    def to_json(self) -> dict[str, Any]:
        """The entry as `GET /admin/audit` and the console show it."""
        return asdict(self)


def is_secret(name: str) -> bool:
    """Whether a setting named `name` holds a secret (its value is never recorded)."""
    lowered = name.lower()
    return lowered.endswith(SECRET_NAMES)


def public_value(name: str, value: Any) -> Any:
    """`value` as the trail may keep it: a secret only as `(set)` / `(unset)`, everything else as
    JSON-ready data (pydantic models dumped, secrets inside them too), cut to `MAX_VALUE_CHARS`."""
    if is_secret(name) or isinstance(value, SecretStr):
        if isinstance(value, str) and value in _MARKERS:
            return value  # already said what it may say
        return "(set)" if value not in (None, "", [], (), {}) else "(unset)"
    if isinstance(value, BaseModel):
        value = {field: public_value(field, getattr(value, field)) for field in type(value).model_fields}
    elif isinstance(value, Mapping):
        value = {str(k): public_value(str(k), v) for k, v in value.items()}
    elif isinstance(value, list | tuple | set | frozenset):
        value = [public_value(name, v) for v in value]
    try:
        text = orjson.dumps(value, default=str).decode()
    except TypeError:
        text = orjson.dumps(str(value)).decode()
    if len(text) <= MAX_VALUE_CHARS:
        return orjson.loads(text)
    return text[:MAX_VALUE_CHARS] + f"... ({len(text)} characters, cut)"


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields whose values differ between `old` and `new` (a field only one has counts, as
    None in the other), each as `public_value` keeps it; secrets say `(changed)`."""
    before, after = {}, {}
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if is_secret(name) or isinstance(a, SecretStr) or isinstance(b, SecretStr):
            before[name], after[name] = public_value(name, a), "(changed)" if b not in (None, "") else "(unset)"
        else:
            before[name], after[name] = public_value(name, a), public_value(name, b)
    return before, after


class AuditTrail:
    """The server's changes, newest last, at most `capacity`; appended and read on the event loop."""

    def __init__(self, capacity: int = CAPACITY, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._entries: deque[AuditEntry] = deque(maxlen=capacity)
        self._clock = clock
        self.recorded = 0  # since the server started (the ring keeps the latest `capacity`)

    def record(self, who: str, via: str, what: str, target: str, old: Any, new: Any, summary: str = "",
               at: float | None = None) -> AuditEntry:
        """Keep one change and log it; `old`/`new` pass through `public_value`. Returns the entry."""
        entry = AuditEntry(self._clock() if at is None else at, who or "admin", via, what, target,
                           public_value(what, old), public_value(what, new),
                           summary or f"{what} of {target or 'the server'} changed")
        self._entries.append(entry)
        self.recorded += 1
        log.info("audit: %s (%s, by %s)", entry.summary, via, entry.who,
                 extra={"event": "audit", "who": entry.who, "via": via, "what": what, "target": target,
                        "old": entry.old, "new": entry.new, "changed_at": entry.at})
        return entry

    def record_fields(self, who: str, via: str, what: str, target: str, old: Mapping[str, Any],
                      new: Mapping[str, Any], at: float | None = None) -> AuditEntry | None:
        """Record the fields that differ between `old` and `new` (None and nothing logged when none
        does); the summary names them."""
        before, after = changed_fields(old, new)
        if not before and not after:
            return None
        names = ", ".join(sorted(set(before) | set(after)))
        return self.record(who, via, what, target, before, after, f"{what} of {target or 'the server'}: {names}",
                           at=at)

    def entries(self, since: float | None = None, limit: int | None = None,
                target: str | None = None) -> list[AuditEntry]:
        """The kept changes, oldest first: after Unix time `since`, of `target` only, the latest
        `limit` of them."""
        chosen: Iterable[AuditEntry] = self._entries
        if since is not None:
            chosen = (e for e in chosen if e.at > since)
        if target is not None:
            chosen = (e for e in chosen if e.target == target)
        found = list(chosen)
        return found[-limit:] if limit is not None and limit >= 0 else found

    def to_json(self, since: float | None = None, limit: int | None = None,
                target: str | None = None) -> list[dict[str, Any]]:
        """`entries` as JSON-ready dicts."""
        return [e.to_json() for e in self.entries(since, limit, target)]


def actor_name(key_id: str | None) -> str:
    """Who an admin API caller is in the trail: `key <id>` for an operator key, else `admin` (the
    admin token, or a trusted loopback client)."""
    return f"key {key_id}" if key_id else "admin"
