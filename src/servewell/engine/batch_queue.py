"""Pure, synchronous queueing rules of one model: priority lanes, deadlines, bounds, shapes, and
weighted fair shares between tenants inside a lane.

No clocks, sockets or event loop here: callers pass `now`, so every rule is unit-tested
directly. `ModelScheduler` drives this from the event loop.

**Tenants** (issue 22). Each lane keeps one deadline-ordered heap per tenant (the API key's
tenant; "" without keys) and a virtual time per tenant: the rows it was given divided by its
weight. A batch is led by the tenant furthest behind (least virtual time; ties by deadline) and
filled by taking, row by row, from whichever same-shape tenant is then furthest behind, so over
time each tenant with work queued gets rows in proportion to its weight (start-time fair
queuing by rows) and a tenant that sends 10x its share waits behind itself. The lane's virtual
clock is the virtual time at which the last row taken started. Rows a tenant got while it was
alone are not held against it when another arrives: a tenant that becomes busy again starts at
its own virtual time, but never more than `BURST_BATCHES` full batches (rows over its weight)
behind the clock. So a tenant that left part of its share unused while idle may spend up to that
much of it at once when it returns: a burst of a tenant within its share is served ahead of a
flood, not interleaved with it row by row (issue 46: a light tenant at 40 % of the model's
capacity saw its p90 grow 2.1x beside a flood at 4x without this credit, 1.1-1.2x with it: the
admission phase of `bench.tenant_fairness`). The credit is only share left unused, and bounded,
so shares over any busy period still follow the weights. A tenant the lane has never served
starts at the clock, with no credit: a flood's first requests never jump the queue.
With one tenant this is the earliest-deadline-first heap it always was.

**Fair admission** (issue 46). A lane's bound is shared by weight too, not first come first
served: when a request meets a full lane, each tenant's share of the lane's places is its weight
over the weights of the tenants holding places (the newcomer's included). The tenant holding the
most places beyond its share gives one up: when that is the newcomer's own tenant, the newcomer
is refused; otherwise that tenant's newest queued request is pushed out (the caller answers it
503 with its tenant named) and the newcomer takes its place. So a tenant within its share is
never refused because another filled the lane, and a flood displaces only itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class QueuedItem(Generic[T]):
    """One request waiting in a lane."""

    payload: T
    lane: int
    rows: int
    shape_key: Hashable
    deadline_at: float
    enqueued_at: float
    seq: int = 0
    cancelled: bool = False
    queued: bool = False
    tenant: str = ""


@dataclass(slots=True, frozen=True)
class Admission(Generic[T]):
    """What `BatchQueue.push` did with a request."""

    admitted: bool
    displaced: QueuedItem[T] | None = None  # another tenant's request pushed out for it (answer it)
    holder: str | None = None  # refused: the tenant holding most of the full lane beyond its share


#: A lane heap's entry: (deadline, sequence, item). A tuple: heapq compares it in C, where the
#: dataclass it was compared in Python, six comparisons per request.
_HeapEntry = tuple[float, int, "QueuedItem[Any]"]


class _Lane:
    """One lane: a deadline heap per tenant, live items and virtual time per tenant."""

    __slots__ = ("heaps", "live", "vtime", "clock")

    def __init__(self) -> None:
        self.heaps: dict[str, list[_HeapEntry]] = {}
        self.live: dict[str, int] = {}  # queued, not cancelled; a tenant with 0 is idle
        self.vtime: dict[str, float] = {}
        self.clock = 0.0  # the virtual time the last row taken started at

    def busy(self) -> list[str]:
        return [tenant for tenant, count in self.live.items() if count > 0]

    def behind(self, tenants: list[str]) -> str:
        """The tenant furthest behind (least virtual time; ties: the earliest deadline at its head)."""
        if len(tenants) == 1:
            return tenants[0]
        return min(tenants, key=lambda t: (self.vtime.get(t, 0.0), _head_deadline(self.heaps[t])))


def _head_deadline(heap: list[_HeapEntry]) -> float:
    _drop_cancelled_head(heap)
    return heap[0][0] if heap else float("inf")


def _drop_cancelled_head(heap: list[_HeapEntry]) -> None:
    while heap and heap[0][2].cancelled:
        heapq.heappop(heap)


#: How many full batches of share a returning tenant may have banked while it was idle (above).
BURST_BATCHES = 4


def _equal_weights(tenant: str) -> float:
    return 1.0


class BatchQueue(Generic[T]):
    """Lanes ordered by priority (lane 0 first); inside a lane, tenants in proportion to their
    weights and earliest deadline first within a tenant; a lower lane gets a batch after
    `max_consecutive_high` higher-lane batches in a row.

    Each lane holds at most `max_queue_size` requests; `push` refuses beyond that so
    memory stays bounded whatever the load. `weight_of(tenant)` is read when a batch is taken,
    so a weight changed live applies to the next batch.
    """

    def __init__(self, lanes: int, max_queue_size: int, max_consecutive_high: int = 8,
                 weight_of: Callable[[str], float] = _equal_weights) -> None:
        self._lanes = [_Lane() for _ in range(lanes)]
        self._counts = [0] * lanes
        self.max_queue_size = max_queue_size
        self.max_consecutive_high = max_consecutive_high
        self.weight_of = weight_of
        self._seq = itertools.count()
        self._streak = 0
        self._credit_rows = 0.0  # BURST_BATCHES of the largest batch asked for last (max_batch_size can change)

    def __len__(self) -> int:
        return sum(self._counts)

    def depth(self, lane: int) -> int:
        """Requests waiting in `lane` (cancelled ones excluded)."""
        return self._counts[lane]

    def tenant_depth(self, tenant: str) -> int:
        """Requests of `tenant` waiting in any lane."""
        return sum(lane.live.get(tenant, 0) for lane in self._lanes)

    def push(self, item: QueuedItem[T]) -> Admission[T]:
        """Queue `item`, by the fair admission rule when its lane is full: `Admission.admitted`
        false means the caller refuses it; `displaced` is a request of another tenant pushed out
        to make room (already out of the queue: the caller answers it)."""
        displaced = None
        if self._counts[item.lane] >= self.max_queue_size:
            holder = self.holder_beyond_share(item.lane, item.tenant)
            if holder == item.tenant:
                return Admission(False, holder=holder)
            displaced = self._newest(item.lane, holder)
            if displaced is None:
                return Admission(False, holder=holder)
            self.cancel(displaced)
        item.seq = next(self._seq)
        item.queued = True
        lane = self._lanes[item.lane]
        tenant = item.tenant
        heap = lane.heaps.get(tenant)
        if heap is None:
            heap = lane.heaps[tenant] = []
        live = lane.live.get(tenant, 0)
        if live == 0:  # busy again: at most `BURST_BATCHES` batches of unused share ahead of the clock
            own = lane.vtime.get(tenant)
            credit = self._credit_rows / self._weight(tenant)
            lane.vtime[tenant] = lane.clock if own is None else max(own, lane.clock - credit)
        lane.live[tenant] = live + 1
        heapq.heappush(heap, (item.deadline_at, item.seq, item))
        self._counts[item.lane] += 1
        return Admission(True, displaced)

    def would_admit(self, lane: int, tenant: str, promised: int = 0) -> bool:
        """Whether a request of `tenant` would be queued in `lane` now (pushing out another
        tenant's if need be): the check before a request's body is read. `promised`: places of the
        lane already promised to requests on their way in (engine/promised.py), counted as taken."""
        if self._counts[lane] + promised < self.max_queue_size:
            return True
        return self.holder_beyond_share(lane, tenant) != tenant

    def holder_beyond_share(self, lane: int, newcomer: str) -> str:
        """The tenant holding the most of full `lane`'s places beyond its weighted share, counting
        one more place for `newcomer` (ties: the newcomer, so a tie never churns the queue)."""
        entries = self._lanes[lane]
        held = {tenant: count for tenant, count in entries.live.items() if count > 0}
        held[newcomer] = held.get(newcomer, 0) + 1
        total_weight = sum(self._weight(t) for t in held)
        if total_weight <= 0:
            return newcomer
        best, best_excess = newcomer, held[newcomer] - self.max_queue_size * self._weight(newcomer) / total_weight
        for tenant, count in held.items():
            excess = count - self.max_queue_size * self._weight(tenant) / total_weight
            if excess > best_excess + 1e-9:
                best, best_excess = tenant, excess
        return best

    def refused_tenants(self, lane: int) -> frozenset[str]:
        """The tenants whose next request full `lane` would refuse (each holds the most beyond its
        share with one more place); others' requests would push out one of theirs."""
        return frozenset(t for t in self.places(lane) if self.holder_beyond_share(lane, t) == t)

    def places(self, lane: int) -> dict[str, int]:
        """Who holds `lane`'s places: queued requests per tenant (tenants with none left out)."""
        return {tenant: count for tenant, count in self._lanes[lane].live.items() if count > 0}

    def _newest(self, lane: int, tenant: str) -> QueuedItem[T] | None:
        """The most recently queued live item of `tenant` in `lane` (a scan of that tenant's heap:
        only when a full lane must push one out)."""
        heap = self._lanes[lane].heaps.get(tenant, [])
        live = [entry[2] for entry in heap if not entry[2].cancelled]
        return max(live, key=lambda i: i.seq) if live else None

    def cancel(self, item: QueuedItem[T]) -> None:
        """Drop `item` if it is still queued; it is discarded lazily and never handed out."""
        if item.queued and not item.cancelled:
            item.cancelled = True
            item.queued = False
            self._counts[item.lane] -= 1
            self._lanes[item.lane].live[item.tenant] -= 1

    def expire(self, now: float) -> list[QueuedItem[T]]:
        """Remove and return every queued item whose deadline is at or before `now`.

        Each tenant's heap is ordered by deadline, so expired items are at its top: this costs
        the expired items and the tenants, not the queue (it runs on every submit and batch).
        """
        expired: list[QueuedItem[T]] = []
        for index, lane in enumerate(self._lanes):
            for tenant, heap in lane.heaps.items():
                while heap and (heap[0][2].cancelled or heap[0][0] <= now):
                    item = heapq.heappop(heap)[2]
                    if item.cancelled:
                        continue
                    item.queued = False
                    expired.append(item)
                    self._counts[index] -= 1
                    lane.live[tenant] -= 1
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of any queued item."""
        best: float | None = None
        for lane in self._lanes:
            for heap in lane.heaps.values():
                deadline = _head_deadline(heap)
                if heap and (best is None or deadline < best):
                    best = deadline
        return best

    def next_lane(self) -> int | None:
        """Lane the next batch comes from: the highest non-empty one, unless it has led
        `max_consecutive_high` batches in a row while a lower lane waited (no starvation)."""
        waiting = [lane for lane, count in enumerate(self._counts) if count > 0]
        if not waiting:
            return None
        if len(waiting) > 1 and self._streak >= self.max_consecutive_high:
            return waiting[1]
        return waiting[0]

    def head(self, lane: int | None = None) -> QueuedItem[T] | None:
        """The item that would lead the next batch (of `lane`, default `next_lane()`)."""
        lane = self.next_lane() if lane is None else lane
        if lane is None:
            return None
        entries = self._lanes[lane]
        busy = entries.busy()
        if not busy:
            return None
        heap = entries.heaps[entries.behind(busy)]
        _drop_cancelled_head(heap)
        return heap[0][2] if heap else None

    def oldest_enqueued_at(self, lane: int) -> float | None:
        """When the longest-waiting item of `lane` arrived."""
        times = [e[2].enqueued_at for heap in self._lanes[lane].heaps.values() for e in heap
                 if not e[2].cancelled]
        return min(times) if times else None

    def ready_rows(self, lane: int, shape_key: Hashable) -> int:
        """Rows queued in `lane` that could join a batch of `shape_key`."""
        return sum(e[2].rows for heap in self._lanes[lane].heaps.values() for e in heap
                   if not e[2].cancelled and e[2].shape_key == shape_key)

    def take_batch(self, max_rows: int, lane: int | None = None) -> list[QueuedItem[T]]:
        """Remove and return the next batch from one lane (lanes never share a batch, so an urgent
        batch stays small): led by the head of the tenant furthest behind, filled with same-shape
        items, each from the tenant then furthest behind (its earliest deadline first), up to
        `max_rows` rows (a single larger item still goes alone)."""
        self._credit_rows = float(BURST_BATCHES * max_rows)
        lane = self.next_lane() if lane is None else lane
        lead = self.head(lane) if lane is not None else None
        if lane is None or lead is None:
            return []
        waiting = [i for i, count in enumerate(self._counts) if count > 0]
        if lane == waiting[0] and len(waiting) > 1:
            self._streak += 1
        else:
            self._streak = 0
        entries = self._lanes[lane]
        candidates = entries.busy()
        batch: list[QueuedItem[T]] = []
        rows = 0
        skipped: list[tuple[list[_HeapEntry], _HeapEntry]] = []
        while candidates and rows < max_rows:
            tenant = entries.behind(candidates)
            item = self._pop_fitting(entries.heaps[tenant], lead.shape_key, max_rows - rows if batch else None, skipped)
            if item is None:
                candidates.remove(tenant)  # nothing more of this tenant fits this batch
                continue
            batch.append(item)
            rows += item.rows
            self._counts[lane] -= 1
            entries.live[tenant] -= 1
            start = entries.vtime.get(tenant, 0.0)
            entries.clock = max(entries.clock, start)
            entries.vtime[tenant] = start + item.rows / self._weight(tenant)
        for heap, entry in skipped:
            heapq.heappush(heap, entry)
        return batch

    def _weight(self, tenant: str) -> float:
        weight = self.weight_of(tenant)
        return weight if weight > 0 else 1.0

    @staticmethod
    def _pop_fitting(heap: list[_HeapEntry], shape_key: Hashable, room: int | None,
                     skipped: list[tuple[list[_HeapEntry], _HeapEntry]]) -> QueuedItem[Any] | None:
        """Pop the earliest-deadline item of `heap` with `shape_key` and at most `room` rows (any
        size when None: the batch's first item); the others popped on the way go to `skipped`."""
        while heap:
            entry = heapq.heappop(heap)
            item = entry[2]
            if item.cancelled:
                continue
            if item.shape_key != shape_key or (room is not None and item.rows > room):
                skipped.append((heap, entry))
                continue
            item.queued = False
            return item
        return None
