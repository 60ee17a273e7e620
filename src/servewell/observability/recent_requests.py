"""Bounded rings of the latest slow and failed requests, for the console, with refusals kept apart.

The HTTP middleware and the gRPC scope record a request here only where they already write a
log line for it (slower than `slow_request_ms`, or answered with an error), so requests that
are neither cost nothing. A record holds what the log line holds: ids, route template, model,
status, error code, the stage breakdown and where the request ran (batch id, batch size, worker
instance, queue position); never a body, an image, a tensor, a raw path or a header value a
client chose (the request id is only kept when it passed the safe-id check).

Which ring a record goes to (`is_refusal`): 250 requests without a key once filled all 200
entries with 401s and the real failures disappeared, so requests turned away for the client's
own fault before any model was involved are counted by code and kept in a small ring of their
own, and the main ring keeps what an operator needs:

- refusals: 401 (no or a wrong key), 403 (no admin right), 429 (rate limited), whatever the
  route; and every other 4xx of a request that named no model of this server (unknown model or
  path, 404/405, a body or header refused before routing). Anyone can send these, as many as
  they like.
- recent: every slow request; every 5xx (overload, deadline, worker lost, model error: the
  server's own failures, whoever caused them); every 4xx of a request that reached one of this
  server's models (invalid input for it, an unknown version), which only a client that got past
  the key check can send when keys are configured.

With ingress processes (issue 20) each keeps its own rings; the engine absorbs their
`view_snapshot()`s (`absorb`, `retire`: the same rules as `metrics_merge.py`) and every reader
(`latest`, `latest_refusals`, `refusal_counts`, `recorded`, the JSON) sees them merged by time,
newest first, bounded by this object's capacities as before.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from servewell.observability.slow_log import SlowRequestLog

#: Records kept; a record is a few hundred bytes, so the buffer stays under about 200 KB.
DEFAULT_CAPACITY = 200
#: Refusals kept one by one (the counts by code cover all of them).
DEFAULT_REFUSAL_CAPACITY = 50
#: Statuses that are refusals whatever the route: the caller's credentials or rate.
REFUSAL_STATUSES = frozenset((401, 403, 429))


def is_refusal(status: int, model: str) -> bool:
    """Whether a request answered `status` for `model` ("" when it named none of this server's) is
    a refusal (kept apart from the recent list; see the module docstring)."""
    return status in REFUSAL_STATUSES or (400 <= status < 500 and not model)


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """One slow or failed request, as the console lists it."""

    request_id: str
    protocol: str  # "http" or "grpc"
    route: str  # the route template ("/v2/models/{name}/infer") or "grpc ModelInfer"; never the raw path
    model: str  # "" when the request named no model of this server
    status: int  # HTTP status (gRPC calls: the HTTP status their error maps from, 499 for a cancel)
    code: str  # the stable error code ("" for a success)
    total_ms: float
    slow: bool  # over the slow-request threshold (a failed request may be fast)
    stages_ms: dict[str, float] = field(default_factory=dict)  # preprocess, queue, compute, postprocess
    at: float = field(default_factory=time.time)  # Unix time the answer left
    # Where it ran (`observability.context.BatchPlacement`); None when it never reached a batch.
    batch_id: int | None = None
    batch_size: int | None = None  # rows of the whole batch
    instance: int | None = None  # worker instance of the model, 0-based
    queue_position: int | None = None  # requests already waiting in its lane when it was queued
    client: str = ""  # the caller's API key id ("" without keys): the console filters by tenant with it

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return asdict(self)

    def fields(self) -> RecordFields:
        """The record's fields in order, as a plain tuple: what a `RecentSnapshot` carries. Pickling
        250 records as tuples took 0.3 ms to dump and 0.2 ms to load where the dataclasses took 1.8
        and 2.9 ms (the engine turns them back into records only when the console reads them)."""
        return (self.request_id, self.protocol, self.route, self.model, self.status, self.code, self.total_ms,
                self.slow, self.stages_ms, self.at, self.batch_id, self.batch_size, self.instance,
                self.queue_position, self.client)

    @classmethod
    def from_fields(cls, fields: RecordFields) -> RequestRecord:
        """The record `fields()` gave."""
        return cls(*fields)


#: `RequestRecord.fields()`: its fields in declaration order.
RecordFields = tuple[Any, ...]


@dataclass(slots=True, frozen=True)
class RecentSnapshot:
    """One process's own rings, cumulative counts since it started (plain data: picklable). At
    most `DEFAULT_CAPACITY + DEFAULT_REFUSAL_CAPACITY` records (`RequestRecord.fields()`) of about
    130 bytes pickled each: 33 KB when both rings are full."""

    incarnation: str  # unique per RecentRequests object: a restarted process has a new one
    sequence: int  # 1, 2, ... per snapshot of this incarnation
    records: tuple[RecordFields, ...]  # newest first
    refusals: tuple[RecordFields, ...]  # newest first
    refusal_counts: dict[str, int]
    recorded: int


def _newest(rings: Iterable[Iterable[RequestRecord]], keep: int) -> list[RequestRecord]:
    # Each ring newest first: merged by the time the answer left, newest first, `keep` at most.
    return list(itertools.islice(heapq.merge(*rings, key=lambda r: r.at, reverse=True), keep))


def _records(snapshot: RecentSnapshot) -> tuple[list[RequestRecord], list[RequestRecord]]:
    return ([RequestRecord.from_fields(f) for f in snapshot.records],
            [RequestRecord.from_fields(f) for f in snapshot.refusals])


#: Records of the main ring, refusals, refusal counts and records since start: what absorbed
#: sources contributed.
_Absorbed = tuple[list[RequestRecord], list[RequestRecord], Counter[str], int]


class RecentRequests:
    """The latest `capacity` slow or failed requests an operator needs, newest last, and apart
    from them the refusals: counts by code since start and the latest `refusal_capacity`.
    Updated and read on the event loop only, like the metrics: no lock."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, refusal_capacity: int = DEFAULT_REFUSAL_CAPACITY,
                 slow_log: SlowRequestLog | None = None) -> None:
        if capacity < 1 or refusal_capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self._refusals: deque[RequestRecord] = deque(maxlen=refusal_capacity)
        # Refusals since start by error code (the status when a refusal had no code). Codes are
        # the server's own taxonomy, never a client's string, so the keys are bounded.
        self._own_refusal_counts: Counter[str] = Counter()
        self._own_recorded = 0  # since start, including those the ring has since dropped (refusals apart)
        self.incarnation = uuid.uuid4().hex
        self._sequence = itertools.count(1)
        # Absorbed from other processes: the latest snapshot per source, and what retired ones left.
        self._sources: dict[str, RecentSnapshot] = {}
        self._base_records: list[RequestRecord] = []  # newest first, what retired sources left
        self._base_refusals: list[RequestRecord] = []
        self._base_counts: Counter[str] = Counter()
        self._base_recorded = 0
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._absorbed: _Absorbed | None = None  # their sum, cached; None after a change
        self._absorbing = False  # True from the first absorb on
        #: The slow-request log lines, rate-limited per model: a slow request reaches it from the
        #: same place it reaches the ring (`api/request_outcome.py`).
        self.slow_log = slow_log if slow_log is not None else SlowRequestLog(logging.getLogger("servewell.api"))

    @property
    def capacity(self) -> int:
        """How many records the main ring keeps."""
        return self._records.maxlen or 0

    def record(self, record: RequestRecord) -> None:
        """Keep `record` in its ring (`is_refusal`), dropping that ring's oldest when it is full."""
        if is_refusal(record.status, record.model):  # even when slow: a flood of slow 401s is still a flood
            self._own_refusal_counts[record.code or str(record.status)] += 1
            self._refusals.append(record)
            return
        self._records.append(record)
        self._own_recorded += 1

    @property
    def refusal_counts(self) -> Counter[str]:
        """Refusals since start by error code (the status when a refusal had no code), of this
        process and every absorbed one. Codes are the server's own taxonomy: the keys are bounded."""
        absorbed = self._absorbed_view()
        return self._own_refusal_counts if absorbed is None else self._own_refusal_counts + absorbed[2]

    @property
    def recorded(self) -> int:
        """Records of the main ring since start, including those it has since dropped (refusals
        apart), of this process and every absorbed one."""
        absorbed = self._absorbed_view()
        return self._own_recorded + (0 if absorbed is None else absorbed[3])

    def latest(self, limit: int | None = None) -> list[RequestRecord]:
        """The newest `limit` records of the main ring (all when None), newest first."""
        absorbed = self._absorbed_view()
        newest_first = list(reversed(self._records)) if absorbed is None else \
            _newest((reversed(self._records), absorbed[0]), self.capacity)
        return newest_first if limit is None else newest_first[:max(0, limit)]

    def latest_refusals(self, limit: int | None = None) -> list[RequestRecord]:
        """The newest `limit` refusals (all kept when None), newest first."""
        absorbed = self._absorbed_view()
        newest_first = list(reversed(self._refusals)) if absorbed is None else \
            _newest((reversed(self._refusals), absorbed[1]), self._refusals.maxlen or 0)
        return newest_first if limit is None else newest_first[:max(0, limit)]

    def view_snapshot(self) -> RecentSnapshot:
        """This process's own rings and counts (never what it absorbed): what an ingress hands
        the engine."""
        return RecentSnapshot(self.incarnation, next(self._sequence),
                              tuple(r.fields() for r in reversed(self._records)),
                              tuple(r.fields() for r in reversed(self._refusals)), dict(self._own_refusal_counts),
                              self._own_recorded)

    def absorb(self, source: str, snapshot: RecentSnapshot) -> bool:
        """Keep `snapshot` as `source`'s latest (the rules of `metrics_merge.AbsorbedMetrics`:
        stale or retired-incarnation snapshots are dropped, False; a new incarnation under a known
        name folds the old one's into what retired sources left)."""
        if snapshot.incarnation in self._retired:
            return False
        previous = self._sources.get(source)
        if previous is not None:
            if previous.incarnation == snapshot.incarnation:
                if snapshot.sequence <= previous.sequence:
                    return False
            else:
                self._fold(previous)
        self._sources[source] = snapshot
        self._absorbed = None
        self._absorbing = True
        return True

    def retire(self, source: str) -> bool:
        """`source` is gone: its records stay until newer ones push them out, its counts for good."""
        previous = self._sources.pop(source, None)
        if previous is None:
            return False
        self._fold(previous)
        self._absorbed = None
        self._absorbing = True
        return True

    def _fold(self, snapshot: RecentSnapshot) -> None:
        records, refusals = _records(snapshot)
        self._base_records = _newest((self._base_records, records), self.capacity)
        self._base_refusals = _newest((self._base_refusals, refusals), self._refusals.maxlen or 0)
        self._base_counts.update(snapshot.refusal_counts)
        self._base_recorded += snapshot.recorded
        self._retired[snapshot.incarnation] = None
        while len(self._retired) > 4096:  # one per restart; enough to drop any late snapshot
            self._retired.popitem(last=False)

    def _absorbed_view(self) -> _Absorbed | None:
        # What other processes contributed (cached until the next absorb or retire); None while
        # nothing was ever absorbed (one process): readers take the own rings as before.
        if not self._absorbing:
            return None
        if self._absorbed is None:
            parts = [_records(p) for p in self._sources.values()]
            counts = Counter(self._base_counts)
            for snapshot in self._sources.values():
                counts.update(snapshot.refusal_counts)
            self._absorbed = (_newest([self._base_records, *(p[0] for p in parts)], self.capacity),
                              _newest([self._base_refusals, *(p[1] for p in parts)], self._refusals.maxlen or 0),
                              counts, self._base_recorded + sum(p.recorded for p in self._sources.values()))
        return self._absorbed

    def to_json(self, limit: int | None = None, clients: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """`latest(limit)` as JSON-ready dicts (only those of `clients`' key ids, when given)."""
        if clients is None:
            return [r.to_json() for r in self.latest(limit)]
        return [r.to_json() for r in self.latest(None) if r.client in clients][:limit]

    def refusals_json(self, limit: int | None = None, clients: frozenset[str] | None = None) -> dict[str, Any]:
        """`{"counts": {code: n}, "recent": [record, ...]}`: every refusal since start by code, and
        the newest `limit` kept, newest first. With `clients` (a tenant's key ids): only their
        records, and no counts (those are the whole server's, every caller's together)."""
        if clients is None:
            return {"counts": dict(sorted(self.refusal_counts.items())),
                    "recent": [r.to_json() for r in self.latest_refusals(limit)]}
        own = [r.to_json() for r in self.latest_refusals(None) if r.client in clients]
        return {"counts": None, "recent": own[:limit]}
