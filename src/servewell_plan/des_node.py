"""The shared machine of `FleetSpec.node_cores`: every replica's CPU work on one node of that many
cores, weighted processor sharing, as Linux's fair scheduler shares cores between threads of
different niceness.

Each job is W seconds of work at full speed on `threads` threads, at a weight: 1 for a replica's
front, the load generator and the balancer, `batch_weight` for a model worker's batch (servewell's
workers run at nice 5 by default, weight 335/1024 in the kernel's table: `nice_weight`). With T_k
runnable threads at weight w_k, a thread of class k progresses at rate min(1, C_k * w_k / S_k), the
water-filling of the cores: the heaviest class gets its weighted share of the `cores` or a whole
core per thread, whichever is less, and the cores it does not use go to the others. With every
weight 1 this is min(1, cores / T), plain processor sharing. Within a class every job progresses at
the same rate, so the class keeps one virtual clock V (dV/dt = rate): a job started at V0 ends when
V reaches V0 + W. Jobs wait in a heap per class by that virtual end, so a change of load costs
O(log n), not a pass over every job.
"""

from __future__ import annotations

import heapq
import math
from enum import IntEnum

from servewell_plan.des_pod import Pod

#: Jobs whose virtual end is within this of the clock finish together (float rounding).
_EPS = 1e-12
#: The kernel's CPU weights of nice 0 to 19 (sched_prio_to_weight), nice 0 = 1024.
_NICE_WEIGHTS = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36, 29, 23, 18, 15)


def nice_weight(nice: int) -> float:
    """A thread's CPU weight at `nice` (0 to 19) relative to one at nice 0."""
    return _NICE_WEIGHTS[min(max(0, nice), len(_NICE_WEIGHTS) - 1)] / _NICE_WEIGHTS[0]


class JobKind(IntEnum):
    """What a node job is, so the simulator knows what its end means."""

    FRONT = 0  # a replica's front serving one request
    BATCH = 1  # one instance running one batch
    EXTRA = 2  # the balancer's CPU per request: only contends
    CLIENT = 3  # the load generator sending one request (`batch` holds its id): one process, in its path


FRONT, BATCH, EXTRA, CLIENT = (int(k) for k in JobKind)
#: The weight classes: every job but a batch, and batches.
NORMAL_CLASS, BATCH_CLASS = 0, 1


class NodeJob:
    """One job on the node: whose it is (`pod`, None for EXTRA) and, for a BATCH, its requests."""

    __slots__ = ("batch", "cancelled", "kind", "pod", "threads", "v_end")

    def __init__(self, kind: int, pod: Pod | None, batch: list[int] | None, threads: int) -> None:
        self.kind = kind
        self.pod = pod
        self.batch = batch
        self.threads = threads
        self.v_end = 0.0
        self.cancelled = False


class _Class:
    """The jobs of one weight: their virtual clock, runnable threads, rate and heap."""

    __slots__ = ("heap", "speed", "threads", "vtime", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.vtime = 0.0
        self.threads = 0
        self.speed = 1.0
        self.heap: list[tuple[float, int, NodeJob]] = []


class SharedNode:
    """The node's jobs and their virtual clocks. The simulator asks `next_finish_s` after each change
    and calls `pop_done` at that time (`gen` tells a current wake-up from a stale one). At equal
    weights both classes are one (`_classes` holds the same object twice): plain processor sharing,
    at its old cost."""

    __slots__ = ("_classes", "_seq", "_unique", "cores", "gen", "last_t", "scheduled_s")

    def __init__(self, cores: float, batch_weight: float = 1.0) -> None:
        if not batch_weight > 0:
            raise ValueError(f"batch_weight must be positive, not {batch_weight}")
        self.cores = cores
        self.last_t = 0.0
        normal = _Class(1.0)
        self._unique = (normal,) if batch_weight == 1.0 else (normal, _Class(batch_weight))
        self._classes = (normal, self._unique[-1])
        self._seq = 0
        self.gen = 0  # bumped each time the simulator schedules a new wake-up
        self.scheduled_s = math.inf  # the wake-up currently scheduled

    @staticmethod
    def class_of(job: NodeJob) -> int:
        """The weight class of a job: a batch's, or everything else's."""
        return BATCH_CLASS if job.kind == BATCH else NORMAL_CLASS

    def vtime(self, cls: int) -> float:
        """A class's virtual clock at the last change."""
        return self._classes[cls].vtime

    def clock(self, t: float) -> tuple[float, float]:
        """Both classes' virtual clocks at `t` (not before the last change): (normal, batch)."""
        normal, batch = self._classes
        return normal.vtime + (t - self.last_t) * normal.speed, batch.vtime + (t - self.last_t) * batch.speed

    def _advance(self, t: float) -> None:
        elapsed = t - self.last_t
        for c in self._unique:
            c.vtime += elapsed * c.speed
        self.last_t = t

    def _rescale(self) -> None:
        """Each class's rate per thread: the cores water-filled by weight, at most 1 per thread."""
        cores = self.cores
        if len(self._unique) == 1:
            c = self._unique[0]
            c.speed = 1.0 if c.threads <= cores else cores / c.threads
            return
        a, b = self._unique  # a at weight 1, b at the batches' weight
        ta, tb, w = a.threads, b.threads, b.weight
        if ta + tb <= cores:
            a.speed = b.speed = 1.0
            return
        total = ta + w * tb
        ra, rb = cores / total, cores * w / total
        # The heavier class first: if it cannot use its share (a core per thread at most), the rest
        # of the cores go to the other.
        if w <= 1.0:
            if ra > 1.0:
                ra, rb = 1.0, (cores - ta) / tb
        elif rb > 1.0:
            ra, rb = (cores - tb) / ta, 1.0
        a.speed = ra if ta else 1.0
        b.speed = rb if tb else 1.0

    def add(self, t: float, job: NodeJob, work_s: float) -> float:
        """Start `job` at `t` with `work_s` of work; returns its class's virtual clock at its start."""
        self._advance(t)
        c = self._classes[BATCH_CLASS if job.kind == BATCH else NORMAL_CLASS]
        start = c.vtime
        job.v_end = start + work_s
        self._seq += 1
        heapq.heappush(c.heap, (job.v_end, self._seq, job))
        c.threads += job.threads
        self._rescale()
        return start

    def cancel_pod(self, t: float, pod: Pod) -> None:
        """Every job of `pod` stops (the pod died): they no longer take CPU."""
        self._advance(t)
        for c in self._unique:
            for _, _, job in c.heap:
                if job.pod is pod and not job.cancelled:
                    job.cancelled = True
                    c.threads -= job.threads
        self._rescale()

    def _first(self) -> _Class | None:
        """The class whose first live job ends first if nothing changes (None: no job)."""
        first: _Class | None = None
        first_wait = math.inf
        for c in self._unique:
            heap = c.heap
            while heap and heap[0][2].cancelled:
                heapq.heappop(heap)
            if heap:
                wait = (heap[0][0] - c.vtime) / c.speed
                if wait < first_wait:
                    first, first_wait = c, wait
        return first

    def next_finish_s(self) -> float:
        """When the next job finishes if nothing changes (inf: no job)."""
        c = self._first()
        if c is None:
            return math.inf
        return self.last_t + max(0.0, c.heap[0][0] - c.vtime) / c.speed

    def pop_done(self, t: float) -> list[NodeJob]:
        """The jobs finished at `t`, the wake-up `next_finish_s` announced: the first one is taken
        even if float rounding left a sliver of its work."""
        self._advance(t)
        first = self._first()
        if first is not None:
            first.vtime = max(first.vtime, first.heap[0][0])
        done: list[NodeJob] = []
        for c in self._unique:
            heap = c.heap
            limit = c.vtime + _EPS * max(1.0, c.vtime)
            while heap and heap[0][0] <= limit:
                job = heapq.heappop(heap)[2]
                if not job.cancelled:
                    done.append(job)
                    c.threads -= job.threads
        self._rescale()
        return done
