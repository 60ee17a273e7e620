"""A bounded ring buffer of the latest slow and failed requests, for the console.

The HTTP middleware and the gRPC scope record a request here only where they already write a
log line for it (slower than `slow_request_ms`, or answered with an error), so requests that
are neither cost nothing. A record holds what the log line holds: ids, route template, model,
status, error code and the stage breakdown; never a body, an image, a tensor, a raw path or a
header value a client chose (the request id is only kept when it passed the safe-id check).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

#: Records kept; a record is a few hundred bytes, so the buffer stays under about 200 KB.
DEFAULT_CAPACITY = 200


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


class RecentRequests:
    """The latest `capacity` slow or failed requests, newest last. Updated and read on the event
    loop only, like the metrics: no lock."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self.recorded = 0  # since start, including those the ring has since dropped

    @property
    def capacity(self) -> int:
        """How many records the ring keeps."""
        return self._records.maxlen or 0

    def record(self, record: RequestRecord) -> None:
        """Keep `record`, dropping the oldest when the ring is full."""
        self._records.append(record)
        self.recorded += 1

    def latest(self, limit: int | None = None) -> list[RequestRecord]:
        """The newest `limit` records (all when None), newest first."""
        newest_first = list(reversed(self._records))
        return newest_first if limit is None else newest_first[:max(0, limit)]

    def to_json(self, limit: int | None = None) -> list[dict[str, Any]]:
        """`latest(limit)` as JSON-ready dicts."""
        return [asdict(r) for r in self.latest(limit)]
