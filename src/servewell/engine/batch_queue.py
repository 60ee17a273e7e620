"""Pure, synchronous queueing rules of one model: priority lanes, deadlines, bounds, shapes.

No clocks, sockets or event loop here: callers pass `now`, so every rule is unit-tested
directly. `ModelScheduler` drives this from the event loop.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
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


@dataclass(order=True, slots=True)
class _HeapEntry:
    deadline_at: float
    seq: int
    item: QueuedItem[Any] = field(compare=False)


class BatchQueue(Generic[T]):
    """Lanes ordered by priority (lane 0 first); earliest deadline first within a lane; a lower
    lane gets a batch after `max_consecutive_high` higher-lane batches in a row.

    Each lane holds at most `max_queue_size` requests; `push` refuses beyond that so
    memory stays bounded whatever the load.
    """

    def __init__(self, lanes: int, max_queue_size: int, max_consecutive_high: int = 8) -> None:
        self._lanes: list[list[_HeapEntry]] = [[] for _ in range(lanes)]
        self._counts = [0] * lanes
        self.max_queue_size = max_queue_size
        self.max_consecutive_high = max_consecutive_high
        self._seq = itertools.count()
        self._streak = 0

    def __len__(self) -> int:
        return sum(self._counts)

    def depth(self, lane: int) -> int:
        """Requests waiting in `lane` (cancelled ones excluded)."""
        return self._counts[lane]

    def push(self, item: QueuedItem[T]) -> bool:
        """Queue `item`; False when its lane is full (the caller refuses the request)."""
        if self._counts[item.lane] >= self.max_queue_size:
            return False
        item.seq = next(self._seq)
        item.queued = True
        heapq.heappush(self._lanes[item.lane], _HeapEntry(item.deadline_at, item.seq, item))
        self._counts[item.lane] += 1
        return True

    def cancel(self, item: QueuedItem[T]) -> None:
        """Drop `item` if it is still queued; it is discarded lazily and never handed out."""
        if item.queued and not item.cancelled:
            item.cancelled = True
            item.queued = False
            self._counts[item.lane] -= 1

    def expire(self, now: float) -> list[QueuedItem[T]]:
        """Remove and return every queued item whose deadline is at or before `now`.

        Each lane is a heap ordered by deadline, so expired items are at its top: this costs
        the expired items, not the queue (it runs on every submit and every finished batch).
        """
        expired: list[QueuedItem[T]] = []
        for lane, heap in enumerate(self._lanes):
            while heap and (heap[0].item.cancelled or heap[0].deadline_at <= now):
                item = heapq.heappop(heap).item
                if item.cancelled:
                    continue
                item.queued = False
                expired.append(item)
                self._counts[lane] -= 1
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of any queued item."""
        best: float | None = None
        for heap in self._lanes:
            self._drop_cancelled_head(heap)
            if heap and (best is None or heap[0].deadline_at < best):
                best = heap[0].deadline_at
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
        heap = self._lanes[lane]
        self._drop_cancelled_head(heap)
        return heap[0].item if heap else None

    def oldest_enqueued_at(self, lane: int) -> float | None:
        """When the longest-waiting item of `lane` arrived."""
        times = [e.item.enqueued_at for e in self._lanes[lane] if not e.item.cancelled]
        return min(times) if times else None

    def ready_rows(self, lane: int, shape_key: Hashable) -> int:
        """Rows queued in `lane` that could join a batch of `shape_key`."""
        return sum(e.item.rows for e in self._lanes[lane] if not e.item.cancelled and e.item.shape_key == shape_key)

    def take_batch(self, max_rows: int, lane: int | None = None) -> list[QueuedItem[T]]:
        """Remove and return the next batch from one lane (lanes never share a batch, so an urgent
        batch stays small): led by that lane's earliest deadline, filled with same-shape items in
        deadline order up to `max_rows` rows (a single larger item still goes alone)."""
        lane = self.next_lane() if lane is None else lane
        lead = self.head(lane) if lane is not None else None
        if lane is None or lead is None:
            return []
        waiting = [i for i, count in enumerate(self._counts) if count > 0]
        if lane == waiting[0] and len(waiting) > 1:
            self._streak += 1
        else:
            self._streak = 0
        heap = self._lanes[lane]
        batch: list[QueuedItem[T]] = []
        rows = 0
        skipped: list[_HeapEntry] = []
        while heap and rows < max_rows:
            entry = heapq.heappop(heap)
            item = entry.item
            if item.cancelled:
                continue
            if item.shape_key != lead.shape_key or (batch and rows + item.rows > max_rows):
                skipped.append(entry)
                continue
            item.queued = False
            batch.append(item)
            rows += item.rows
            self._counts[lane] -= 1
        for entry in skipped:
            heapq.heappush(heap, entry)
        return batch

    def _drop_cancelled_head(self, heap: list[_HeapEntry]) -> None:
        while heap and heap[0].item.cancelled:
            heapq.heappop(heap)
