"""The response cache of one model version (`cache:` in model.yaml, issue 22).

It lives in the engine process, one per model version for the whole server: every ingress's
requests reach the same cache, and a reload (a new version or a changed model.yaml) builds a new
entry with an empty cache. Answers are keyed on a 128-bit BLAKE2b hash of the input tensors
(name, dtype, shape and bytes; `BYTES` elements by their bytes); nothing else a request carries
changes a model's answer in the engine: output selection, encodings and labels are applied by
the ingress afterwards, lanes and deadlines only decide when it runs.

* A hit is answered at once, with the stored copy of the outputs (read-only arrays), without
  queueing, batching or a worker.
* A miss computes as before; when it succeeds its outputs are copied (a request's rows are views
  of its whole batch) and kept, least recently used dropped first past `max_bytes`. An answer
  larger than a quarter of `max_bytes` is not kept: one answer never empties the cache.
* Identical requests that arrive while the first is computing wait for its answer instead of
  computing again (coalesced), each up to its own deadline. When the first fails or is cancelled
  (its client left) each waiting one computes for itself: an error is never shared, since it
  may be the first request's own (its deadline, its cancel).
* An answer older than `ttl_s` is not served (dropped when found).

Costs on a miss: one hash of the inputs (about 1 GB/s) and one copy of the outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from servewell.config.cache import ResponseCacheConfig
from servewell.engine.protocol import RequestResult
from servewell.errors import DeadlineExceeded
from servewell.observability.metrics import ServeMetrics

#: Bytes counted per kept answer beyond its arrays (the key, the dict entries, the array headers).
ENTRY_OVERHEAD_BYTES = 256
#: A kept answer may take at most this share of `max_bytes`.
LARGEST_SHARE = 4
CACHE_RESULTS = ("hit", "miss", "coalesced")
EVICTION_REASONS = ("size", "ttl")

Submit = Callable[[], "asyncio.Future[RequestResult]"]


def input_key(inputs: dict[str, np.ndarray]) -> bytes:
    """The hash that identifies a request's inputs (order of the names does not matter)."""
    digest = hashlib.blake2b(digest_size=16)
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


def _kept_copy(outputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """Outputs copied into memory of their own (read-only), and the bytes they hold."""
    kept: dict[str, np.ndarray] = {}
    size = ENTRY_OVERHEAD_BYTES
    for name, array in outputs.items():
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        kept[name] = copy
        size += copy.nbytes + (sum(sys.getsizeof(x) for x in copy.flat) if copy.dtype.hasobject else 0)
    return kept, size


@dataclass(slots=True)
class _Kept:
    outputs: dict[str, np.ndarray]
    size: int
    expires_at: float


class ResponseCache:
    """Kept answers and computations in flight of one model version."""

    def __init__(self, model: str, config: ResponseCacheConfig, metrics: ServeMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, version: str = "") -> None:
        self.model = model
        self.version = version  # the version whose answers it keeps (a hit says so)
        self.config = config  # model.yaml's bounds (an admin's change returns to them with null)
        self.max_bytes = config.max_bytes
        self.ttl_s = config.ttl_s
        self._clock = clock
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[RequestResult]] = {}
        self.bytes = 0
        self.counts = dict.fromkeys(CACHE_RESULTS + tuple(f"evicted_{r}" for r in EVICTION_REASONS), 0)
        self._metrics = metrics
        if metrics is not None:  # series exist from the start, so increase() sees the first event
            for result in CACHE_RESULTS:
                metrics.cache_requests.labels(model, result)
            for reason in EVICTION_REASONS:
                metrics.cache_evictions.labels(model, reason)

    @property
    def entries(self) -> int:
        """Answers kept now."""
        return len(self._kept)

    def serve(self, inputs: dict[str, np.ndarray], deadline_at: float, submit: Submit,
              served: Callable[[], None] = lambda: None) -> asyncio.Future[RequestResult]:
        """The answer to `inputs`: kept, shared with an identical request in flight, or computed by
        `submit()` (whose errors, such as a full queue, are raised as they are). `served()` is
        called for each answer that did not compute (the scheduler counts the ones that did)."""
        key = input_key(inputs)
        leader = self._inflight.get(key)
        if leader is not None and leader.done():
            self._landed(key, leader)  # answered in this loop turn, its callback not run yet: keep it now
            leader = None
        kept = self._lookup(key)
        if kept is not None:
            self._count("hit")
            served()
            future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
            future.set_result(RequestResult(kept.outputs, 0.0, 0.0, 0, cache="hit", version=self.version))
            return future
        if leader is not None:
            self._count("coalesced")
            return asyncio.ensure_future(self._follow(key, leader, deadline_at, submit, served))
        return self._lead(key, submit)

    def _lead(self, key: bytes, submit: Submit) -> asyncio.Future[RequestResult]:
        future = submit()
        self._count("miss")
        self._inflight[key] = future
        future.add_done_callback(partial(self._landed, key))
        return future

    async def _follow(self, key: bytes, leader: asyncio.Future[RequestResult], deadline_at: float, submit: Submit,
                      served: Callable[[], None]) -> RequestResult:
        try:
            result = await asyncio.wait_for(asyncio.shield(leader), max(0.0, deadline_at - self._clock()))
        except TimeoutError:
            raise DeadlineExceeded("the request's deadline passed while it waited for the answer of an identical "
                                   "request being computed") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not leader.cancelled() or (task is not None and task.cancelling()):
                raise  # this request's own cancel (its client left)
        except Exception:  # the first request's error may be its own (its deadline): compute this one
            pass
        else:
            served()
            return dataclasses.replace(result, cache="coalesced")
        return await self._lead(key, submit)

    def _landed(self, key: bytes, future: asyncio.Future[RequestResult]) -> None:
        if self._inflight.get(key) is not future:
            return  # taken already (`serve` found it done), or a newer computation of the same inputs leads
        del self._inflight[key]
        if future.cancelled() or future.exception() is not None:
            return
        self._keep(key, future.result().outputs)

    def _lookup(self, key: bytes) -> _Kept | None:
        kept = self._kept.get(key)
        if kept is None:
            return None
        if kept.expires_at <= self._clock():
            self._drop(key, "ttl")
            return None
        self._kept.move_to_end(key)
        return kept

    def _keep(self, key: bytes, outputs: dict[str, np.ndarray]) -> None:
        copies, size = _kept_copy(outputs)
        if size * LARGEST_SHARE > self.max_bytes:
            return
        if key in self._kept:
            self._drop(key, None)
        self._kept[key] = _Kept(copies, size, self._clock() + self.ttl_s)
        self.bytes += size
        while self.bytes > self.max_bytes and self._kept:
            self._drop(next(iter(self._kept)), "size")

    def _drop(self, key: bytes, reason: str | None) -> None:
        self.bytes -= self._kept.pop(key).size
        if reason is not None:
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
            while self.bytes > self.max_bytes and self._kept:
                self._drop(next(iter(self._kept)), "size")

    def clear(self) -> int:
        """Drop every kept answer (computations in flight still answer their requests); how many."""
        dropped = len(self._kept)
        self._kept.clear()
        self.bytes = 0
        return dropped

    def report(self) -> dict[str, Any]:
        """Settings, what it holds and its counts, for the admin API and the model's report."""
        return {"max_bytes": self.max_bytes, "ttl_s": self.ttl_s, "bytes": self.bytes, "entries": len(self._kept),
                "in_flight": len(self._inflight), **self.counts}
