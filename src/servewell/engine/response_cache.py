"""The response cache of one model version (`cache:` in model.yaml, issues 22 and 45).

It lives in the engine process, one per model version for the whole server: every ingress's
requests reach the same cache, and a reload (a new version or a changed model.yaml) builds a new
entry with an empty cache. Answers are keyed on a 128-bit BLAKE2b hash of the tenant and the input
tensors (name, dtype, shape and bytes; `BYTES` elements by their bytes); nothing else a request
carries changes a model's answer in the engine: output selection, encodings and labels are applied
by the ingress afterwards, lanes and deadlines only decide when it runs.

* Tenants are kept apart: a tenant's answers and computations are its own, since a hit (its
  `Server-Timing`, its speed) would tell another tenant what this one sent. `shared_across_tenants`
  lifts that for a model whose inputs are not private (the tenant is then left out of the key).
* A hit is answered at once, with the stored answer (read-only arrays), without queueing,
  batching or a worker.
* A miss computes as before; when it succeeds its outputs are copied (a request's rows are views
  of its whole batch) and kept, least recently used dropped first past `max_bytes`, which counts
  what an answer really holds in the engine (`entry_bytes`). An answer larger than a quarter of
  `max_bytes` is not kept: one answer never empties the cache.
* Identical requests that arrive while one is computing wait for that computation instead of
  computing again (coalesced), each up to its own deadline (`shared_computation.py`). The
  computation is the cache's, not its first request's: when that request leaves (its client went
  away) the others still get the answer; only when every request waiting for it is gone is it
  dropped (before compute, if it has not started). An error is never shared, since it may be the
  first request's own (its deadline): the requests still waiting share one new computation.
* An answer older than `ttl_s` is never served, and is dropped when its time comes (it is not
  counted in `entries` or `bytes` after that).
* Reuse intervals: a hit, and a miss for inputs whose answer was kept before (dropped by `ttl_s` or
  `max_bytes`; the last `GHOST_KEYS` such keys are remembered, 16 bytes and a time each), observe
  the time since those inputs were last asked for (`servewell_response_cache_reuse_interval_seconds`)
  and count it within or beyond the TTL (`servewell_response_cache_reuses_total{vs_ttl}`): callers
  that repeat an input every 30 s get nothing from a 2 s TTL, and this is how the console, the
  alerts and `/healthz` tell.

Costs on a miss: one hash of the inputs (about 1 GB/s) and one copy of the outputs.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from servewell.config.cache import ResponseCacheConfig
from servewell.engine.clock import Clock, TimerHandle
from servewell.engine.protocol import RequestResult
from servewell.engine.shared_computation import Count, SharedComputations, Submit, uncounted
from servewell.observability.metrics import ServeMetrics

#: What one kept answer holds beyond its key and its arrays, measured with tracemalloc on CPython
#: 3.11 (64-bit): its record (56 B), the answer a hit returns (88 B), its outputs dict (184 B up to
#: five outputs), its expiry time and size (56 B), its place in the LRU table (the dict's entry and
#: index, the ordered dict's node: 30-140 B, the most just after the table grew) and in the expiry
#: heap (a 56 B tuple and its slot, plus up to a quarter more for stale pairs and their keys).
#: Counted high rather than low: `max_bytes` bounds the engine's memory, not the arrays' bytes. A
#: 4-float answer counts 881 B: 1.16x what tracemalloc sees it hold, 1.08x the engine's resident
#: growth per answer (bench.hostile cache_memory; 256 B was counted before, about 990 B held).
ENTRY_OVERHEAD_BYTES = 640
#: What one kept array holds beyond `sys.getsizeof` (its header and owned data): its shape and
#: strides, allocated apart, and the allocator's headers of that block and of its data.
ARRAY_OVERHEAD_BYTES = 48
#: A kept answer may take at most this share of `max_bytes`.
LARGEST_SHARE = 4
#: An answer's key (`input_key`): named apart, as the cache's `bytes` property hides the builtin in its class.
Key = bytes
CACHE_RESULTS = ("hit", "miss", "coalesced")
EVICTION_REASONS = ("size", "ttl")
#: Keys of dropped answers whose last use is remembered, per cache, for the reuse intervals of
#: misses: at most this many, and at most a 64th of `max_bytes` at `GHOST_ENTRY_BYTES` each (the
#: key's bytes object is the dropped answer's own; its time and its place in the table, about 150
#: bytes, are new). `ENTRY_OVERHEAD_BYTES` counts each kept answer about 1.16x what it holds, which
#: covers this table: `max_bytes` still bounds what the cache holds (tests/unit/engine/
#: test_response_cache_memory.py).
GHOST_KEYS = 2048
GHOST_ENTRY_BYTES = 200
#: A reuse came `within` the TTL (it could be a hit) or `beyond` it (the answer had expired).
REUSE_VS_TTL = ("within", "beyond")

__all__ = ["CACHE_RESULTS", "EVICTION_REASONS", "ResponseCache", "entry_bytes", "input_key"]


def input_key(inputs: dict[str, np.ndarray], scope: str = "") -> bytes:
    """The hash that identifies a request's inputs within `scope` (a tenant's id; "" when the
    answers are shared); the order of the names does not matter."""
    digest = hashlib.blake2b(digest_size=16)
    scoped = scope.encode()
    digest.update(len(scoped).to_bytes(4, "little"))  # length first: no scope is a prefix of another
    digest.update(scoped)
    for name in sorted(inputs):
        array = inputs[name]
        digest.update(f"{len(name)}:{name}{array.dtype.str}{array.shape}".encode())
        if array.dtype.hasobject:
            for item in array.flat:
                raw = item if isinstance(item, bytes) else str(item).encode()
                digest.update(b"b" if isinstance(item, bytes) else b"s")
                digest.update(len(raw).to_bytes(8, "little"))
                digest.update(raw)
        else:
            digest.update(np.ascontiguousarray(array).data)
    return digest.digest()


def entry_bytes(key: bytes, outputs: dict[str, np.ndarray]) -> int:
    """The engine memory one kept answer takes: its key, its arrays (headers, shapes, data, the
    objects of `BYTES` elements) and the cache's records around them (`ENTRY_OVERHEAD_BYTES`)."""
    size = ENTRY_OVERHEAD_BYTES + sys.getsizeof(key)
    for array in outputs.values():
        size += sys.getsizeof(array) + ARRAY_OVERHEAD_BYTES
        if array.dtype.hasobject:
            size += sum(sys.getsizeof(x) for x in array.flat)
    return size


def _kept_answer(outputs: dict[str, np.ndarray], version: str) -> RequestResult:
    """Outputs copied into memory of their own (read-only), as the answer every hit returns."""
    kept: dict[str, np.ndarray] = {}
    for name, array in outputs.items():
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        kept[sys.intern(name)] = copy  # every answer of the model shares one string per output name
    return RequestResult(kept, 0.0, 0.0, 0, cache="hit", version=version)


@dataclass(slots=True)
class _Kept:
    answer: RequestResult
    size: int
    expires_at: float
    used_at: float  # when its inputs were last asked for (kept, or served)


class _MonotonicClock:
    """The deadline clock (`time.monotonic()`, the loop's `time()`) readable outside the loop too:
    the cache's counts are read by the metrics scrape."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


class ResponseCache:
    """Kept answers and computations in flight of one model version."""

    def __init__(self, model: str, config: ResponseCacheConfig, metrics: ServeMetrics | None = None,
                 clock: Clock | None = None, version: str = "") -> None:
        self.model = model
        self.version = version  # the version whose answers it keeps (a hit says so)
        self.config = config  # model.yaml's bounds (an admin's change returns to them with null)
        self.max_bytes = config.max_bytes
        self.ttl_s = config.ttl_s
        self.shared_across_tenants = config.shared_across_tenants
        self._clock: Clock = clock or _MonotonicClock()
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()
        #: (expires_at, key) of kept answers, soonest first; a key dropped or kept again since leaves
        #: a stale pair, skipped when it comes up (and the heap rebuilt when they pile up).
        self._expiry: list[tuple[float, Key]] = []
        self._computing = SharedComputations(self._clock, self._keep, lambda: self._count("miss"))
        self._bytes = 0
        #: Keys of dropped answers -> when their inputs were last asked for (`GHOST_KEYS` at most).
        self._ghosts: OrderedDict[Key, float] = OrderedDict()
        self.counts = dict.fromkeys(CACHE_RESULTS + tuple(f"evicted_{r}" for r in EVICTION_REASONS)
                                    + tuple(f"reused_{r}_ttl" for r in REUSE_VS_TTL), 0)
        self._metrics = metrics
        if metrics is not None:  # series exist from the start, so increase() sees the first event
            for result in CACHE_RESULTS:
                metrics.cache_requests.labels(model, result)
            for reason in EVICTION_REASONS:
                metrics.cache_evictions.labels(model, reason)
            for vs_ttl in REUSE_VS_TTL:
                metrics.cache_reuses.labels(model, vs_ttl)

    @property
    def entries(self) -> int:
        """Answers kept now (those past `ttl_s` are dropped first)."""
        self._drop_expired(self._clock.now())
        return len(self._kept)

    @property
    def bytes(self) -> int:
        """Engine memory the answers kept now take (`entry_bytes`; those past `ttl_s` dropped first)."""
        self._drop_expired(self._clock.now())
        return self._bytes

    def serve(self, inputs: dict[str, np.ndarray], deadline_at: float, submit: Submit, count: Count = uncounted,
              tenant: str = "") -> asyncio.Future[RequestResult]:
        """The answer to `inputs` for `tenant`: kept, shared with an identical request in flight, or
        computed by `submit()` (whose errors, such as a full queue, are raised as they are).
        `count(outcome)` counts the outcome of each request whose computation's own outcome the
        scheduler does not count (hits, requests that shared a computation)."""
        key = input_key(inputs, "" if self.shared_across_tenants else tenant)
        now = self._clock.now()
        self._drop_expired(now)
        self._computing.settle(key)  # a computation answered in this loop turn keeps its answer now
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            self._reused(now - kept.used_at)
            kept.used_at = now
            self._count("hit")
            count("success")
            future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
            future.set_result(kept.answer)
            return future
        if self._computing.has(key):
            self._count("coalesced")
            return self._computing.join(key, deadline_at, submit, count)
        last_used = self._ghosts.pop(key, None)
        if last_used is not None:  # kept once, dropped since: how long its callers took to ask again
            self._reused(now - last_used)
        return self._computing.lead(key, submit, deadline_at, count)

    def _reused(self, interval_s: float) -> None:
        vs_ttl = "within" if interval_s <= self.ttl_s else "beyond"
        self.counts[f"reused_{vs_ttl}_ttl"] += 1
        if self._metrics is not None:
            self._metrics.cache_reuse_interval.labels(self.model).observe(interval_s)
            self._metrics.cache_reuses.labels(self.model, vs_ttl).inc()

    def _keep(self, key: Key, computed: RequestResult) -> None:
        if sum(a.nbytes for a in computed.outputs.values()) * LARGEST_SHARE > self.max_bytes:
            return  # too large whatever its overhead: not even copied
        answer = _kept_answer(computed.outputs, self.version)
        size = entry_bytes(key, answer.outputs)  # of the copies: a row of a batch is a view, its bytes not its own
        if size * LARGEST_SHARE > self.max_bytes:
            return
        if key in self._kept:
            self._drop(key, None)
        now = self._clock.now()
        expires_at = now + self.ttl_s
        self._kept[key] = _Kept(answer, size, expires_at, now)
        heapq.heappush(self._expiry, (expires_at, key))
        self._bytes += size
        while self._bytes > self.max_bytes and self._kept:
            self._drop(next(iter(self._kept)), "size")
        if len(self._expiry) > len(self._kept) + (len(self._kept) >> 2) + 64:  # stale pairs: O(1) amortized
            self._expiry = [(kept.expires_at, k) for k, kept in self._kept.items()]
            heapq.heapify(self._expiry)

    def _drop_expired(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, key = heapq.heappop(expiry)
            kept = self._kept.get(key)
            if kept is not None and kept.expires_at <= now:
                self._drop(key, "ttl")

    def _drop(self, key: Key, reason: str | None) -> None:
        kept = self._kept.pop(key)
        self._bytes -= kept.size
        if reason is not None:
            ghosts = self._ghosts
            ghosts[key] = kept.used_at
            while len(ghosts) > min(GHOST_KEYS, self.max_bytes // (64 * GHOST_ENTRY_BYTES)):
                ghosts.popitem(last=False)
            self.counts[f"evicted_{reason}"] += 1
            if self._metrics is not None:
                self._metrics.cache_evictions.labels(self.model, reason).inc()

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        if self._metrics is not None:
            self._metrics.cache_requests.labels(self.model, result).inc()

    def resize(self, max_bytes: int | None = None, ttl_s: float | None = None) -> None:
        """New bounds from now on (an admin's live change): past the new `max_bytes` the least
        recently used answers go at once; a new `ttl_s` applies to answers kept from now on."""
        if ttl_s is not None:
            self.ttl_s = ttl_s
        if max_bytes is not None:
            self.max_bytes = max_bytes
            while self._bytes > self.max_bytes and self._kept:
                self._drop(next(iter(self._kept)), "size")

    def clear(self) -> int:
        """Drop every kept answer (computations in flight still answer their requests); how many."""
        self._drop_expired(self._clock.now())
        dropped = len(self._kept)
        self._kept = OrderedDict()  # a new table: clear() would keep the old one's size
        self._ghosts = OrderedDict()
        self._expiry = []
        self._bytes = 0
        return dropped

    def report(self) -> dict[str, Any]:
        """Settings, what it holds and its counts, for the admin API and the model's report."""
        return {"max_bytes": self.max_bytes, "ttl_s": self.ttl_s, "shared_across_tenants": self.shared_across_tenants,
                "bytes": self.bytes, "entries": self.entries, "in_flight": self._computing.in_flight, **self.counts}
